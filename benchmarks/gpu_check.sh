#!/usr/bin/env bash
# The CUDA check of issue 13, about 5 minutes on a GPU machine: the gpu-marked tests, offline throughput of the
# engine on the SmolLM-135M shape in fp32 and bf16, greedy parity with HF transformers on CUDA (the FlexAttention
# backend and chunked prefill on every own family and on the sliding window first, then the rest of
# tests/integration/engine/test_equivalence.py, the window and int8 / AWQ / GPTQ suites, as far as their time allows).
#   benchmarks/gpu_check.sh                      # PYTHON=/path/to/python (one with a CUDA torch) to override
# The engine picks CUDA by itself (device auto) and with it the FlexAttention backend, compiled (the first
# steps compile it; engine/executor/attention/flex_backend.py); HF references run on the CPU. Figures: benchmarks/results/
# offline-gpu.{json,png}; the pytest summaries and the device name are printed. What the first run on an H200
# found: docs/operations.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: CUDA is not available to this python")
print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)' || exit 1
# A step runs even when the one before failed, so that one lease reports everything; the summary names failures.
failed=()
step() { local name=$1; shift; echo "gpu_check: step $name"; "$@" || failed+=("$name (exit $?)"); }
step gpu-marked timeout 60 "$PY" -m pytest -q -p no:cacheprovider -m gpu $(grep -rl 'mark.gpu' tests)
step offline timeout 150 "$PY" benchmarks/offline.py --systems pagedserve --dtypes float32,bfloat16 --tag gpu
parity=(tests/integration/engine/test_equivalence.py tests/integration/engine/test_owned_model_window.py)
core='flex or (test_greedy_matches_transformers and chunked_prefill)'
step parity-core timeout 120 "$PY" -m pytest -q -p no:cacheprovider -k "$core" "${parity[@]}"
step parity-rest timeout 150 "$PY" -m pytest -q -p no:cacheprovider -k "not ($core)" "${parity[@]}" \
  tests/integration/engine/test_quantization.py
if ((${#failed[@]})); then printf 'gpu_check: FAILED %s\n' "${failed[@]}"; exit 1; fi
echo "gpu_check: all steps passed"
