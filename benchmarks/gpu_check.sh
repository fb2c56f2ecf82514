#!/usr/bin/env bash
# The CUDA check of issue 13, under 5 minutes on a GPU machine: greedy parity with HF transformers on CUDA
# (every family and scheduling path of tests/engine/test_equivalence.py, the sliding window, int8 / AWQ / GPTQ,
# the gpu-marked tests), then offline throughput of the engine on the SmolLM-135M shape in fp32 and bf16.
#   benchmarks/gpu_check.sh                      # PYTHON=/path/to/python (one with a CUDA torch) to override
# The engine picks CUDA by itself (device auto) and with it the FlexAttention backend, compiled (the first
# steps compile it; engine/executor/attention/flex_backend.py); HF references run on the CPU. Figures: benchmarks/results/
# offline-gpu.{json,png}; the pytest summaries and the device name are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: CUDA is not available to this python")
print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
timeout 200 "$PY" -m pytest -q -p no:cacheprovider -m 'not slow' tests/engine/test_equivalence.py \
  tests/engine/test_owned_model_window.py tests/engine/test_quantization.py
timeout 60 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/
timeout 120 "$PY" benchmarks/offline.py --systems pagedserve --dtypes float32,bfloat16 --tag gpu
