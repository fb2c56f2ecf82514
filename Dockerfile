# syntax=docker/dockerfile:1
# pagedserve on NVIDIA GPUs, in the spirit of the vllm/vllm-openai image: one replica per container.
#   docker build -t pagedserve .
#   docker run --gpus all --init --stop-timeout 30 -p 127.0.0.1:8000:8000 pagedserve
# The torch CUDA wheel ships its own CUDA libraries (cuBLAS, cuDNN, NCCL as pip packages), so the base
# image only has to match the driver; CUDA_VERSION and TORCH_INDEX must name the same CUDA release.
# Base image by tag; to pin it, pass its digest (looked up for your platform with
# `docker buildx imagetools inspect nvidia/cuda:12.8.1-runtime-ubuntu24.04`): --build-arg CUDA_DIGEST=@sha256:<digest>
ARG CUDA_VERSION=12.8.1
ARG CUDA_DIGEST=""
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04${CUDA_DIGEST} AS runtime

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

# Dependencies first, in layers that only pyproject.toml invalidates: a code edit rebuilds none of them.
# torch pinned and from the CUDA index: the project's own `torch==2.13.0` is then already met and pip
# never pulls a second build from PyPI.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url ${TORCH_INDEX} torch==${TORCH_VERSION}
WORKDIR /app
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"

COPY deploy/image/healthcheck.py /opt/pagedserve/

# Sources last. Editable: the packages stay in /app, beside models/, where the CLI looks for the defaults.
COPY README.md ./
COPY engine/ engine/
COPY resilience/ resilience/
COPY service/ service/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps -e .

# The shipped default models (a primary and its smaller fallback), read-only at run time.
COPY models/ models/

RUN useradd --system --create-home --uid 10001 pagedserve
USER pagedserve

# MODEL: a model directory to serve alone; empty serves the shipped pagedserve-coder-small with
# pagedserve-coder-tiny as its fallback. MAX_GPU_MEMORY_UTILIZATION: the fraction of the GPU's total memory
# this replica's process may bring the device's usage to (weights + KV cache; memory other processes hold
# counts against it). HOST, PORT: read by the server. SHUTDOWN_TIMEOUT: seconds in-flight requests may take
# to finish on SIGTERM (--shutdown-timeout); the stop timeout must exceed it by ~20 s.
ENV MODEL="" \
    MAX_GPU_MEMORY_UTILIZATION=0.9 \
    HOST=0.0.0.0 \
    PORT=8000 \
    SHUTDOWN_TIMEOUT=10 \
    HEALTHCHECK_START_PERIOD=120

EXPOSE 8000
# Liveness, not readiness: a draining or loading replica is alive. Docker only marks a container unhealthy;
# this check also stops the replica after 3 failures in a row so the restart policy replaces it.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "/opt/pagedserve/healthcheck.py"]
# SIGTERM: the replica stops admitting work (503), finishes in-flight streams, then exits. Run it under
# an init (`docker run --init`, compose `init: true`) so a SIGTERM before the server is up still stops it.
STOPSIGNAL SIGTERM
# shell form only to expand $SHUTDOWN_TIMEOUT (the server reads HOST and PORT itself); exec: no shell stays
CMD ["sh", "-c", "exec pagedserve serve --shutdown-timeout \"$SHUTDOWN_TIMEOUT\""]
