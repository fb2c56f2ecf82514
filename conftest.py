"""Repo-root conftest: its presence puts the repo root on sys.path (so tests can import benchmarks.*).

Hub access is switched off for the whole test session; set here because huggingface_hub reads it
once, at its first import, which may come from any test module.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
