"""The third-party clients users reach us with (the `clients` extra): the in-process apps of
tests/conftest.py (`start`, `sdk`) over real tiny engines, served to them by URL."""

import os

os.environ.setdefault(
    "LITELLM_LOCAL_MODEL_COST_MAP", "True"
)  # litellm fetches its price list at import otherwise
