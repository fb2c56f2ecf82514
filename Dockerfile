# syntax=docker/dockerfile:1
# pagedserve on NVIDIA GPUs, in the spirit of the vllm/vllm-openai image: one replica per container.
#   docker build -t pagedserve .
#   docker run --gpus all -p 8000:8000 pagedserve
# The torch CUDA wheel ships its own CUDA libraries (cuBLAS, cuDNN, NCCL as pip packages), so the base
# image only has to match the driver; CUDA_VERSION and TORCH_INDEX must name the same CUDA release.
ARG CUDA_VERSION=12.8.1
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first, pinned and from the CUDA index: the project's own `torch==2.13.0` is then already met
# and pip never pulls a second build from PyPI.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url ${TORCH_INDEX} torch==${TORCH_VERSION}

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine/ engine/
COPY resilience/ resilience/
COPY service/ service/
# editable: the packages stay in /app, beside models/, where the CLI looks for the shipped defaults
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -e . \
    && python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"

# The shipped default models (a primary and its smaller fallback), read-only at run time.
COPY models/ models/

RUN useradd --system --create-home --uid 10001 pagedserve
USER pagedserve

# MODEL: a model directory to serve alone; empty serves the shipped pagedserve-coder-small with
# pagedserve-coder-tiny as its fallback. MAX_GPU_MEMORY_UTILIZATION: the fraction of GPU memory the
# replica may take (weights + KV cache).
ENV MODEL="" \
    MAX_GPU_MEMORY_UTILIZATION=0.9

EXPOSE 8000
# Liveness, not readiness: a draining or loading replica is alive and must not be restarted.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/live', timeout=2)"]
# SIGTERM: the replica stops admitting work (503), finishes in-flight streams, then exits;
# give it a stop timeout longer than the longest generation (docker run --stop-timeout / stop_grace_period).
STOPSIGNAL SIGTERM
CMD ["pagedserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
