# syntax=docker/dockerfile:1
# batchasr: HTTP API + engine (`batchasr serve`, the default) or a job consumer (`batchasr worker`).
#
#   docker build -t batchasr:0.1.0 .
#   docker run --gpus all -p 8000:8000 batchasr:0.1.0                      # embedded default model
#   docker run --gpus all -p 8000:8000 -v "$PWD/models:/models:ro" \
#       -e BATCHASR_MODEL=/models/parakeet-tdt-0.6b-v2.nemo batchasr:0.1.0   # a model of your own
#
# Settings come from BATCHASR_* environment variables (service/config.py).

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# --- 1. the project as a wheel (pure Python; carries the embedded model from models/assets) ---------------
FROM python:3.12-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY models ./models
COPY decoding ./decoding
COPY service ./service
# An image without its default model would fail `batchasr serve` with no BATCHASR_MODEL: refuse to build it
# unless asked to (REQUIRE_DEFAULT_MODEL=0, for images that always mount a model).
ARG REQUIRE_DEFAULT_MODEL=1
RUN if [ "$REQUIRE_DEFAULT_MODEL" = "1" ] && [ ! -f models/assets/default.nemo ]; then \
        echo "models/assets/default.nemo is missing (build with --build-arg REQUIRE_DEFAULT_MODEL=0 to skip)" >&2; \
        exit 1; \
    fi \
 && pip wheel --no-deps --no-cache-dir --wheel-dir /wheels .

# --- 2. a virtual environment with CUDA torch, cuda-python and the wheel ------------------------------------
FROM ${CUDA_IMAGE} AS venv
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, in its own layer: it is most of the image and changes least often.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC="torch>=2.7,<3"
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
# cuda-python: conditional WHILE nodes for label looping in CUDA graphs (decoding/cuda_conditional.py)
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl "cuda-python>=12.6,<13" && rm -rf /wheels

# --- 3. runtime: the CUDA base, Python and the venv; no build tools, no pip cache -------------------------
FROM ${CUDA_IMAGE} AS runtime
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 batchasr \
 && useradd --system --uid 10001 --gid batchasr --home-dir /home/batchasr --create-home batchasr
COPY --from=venv /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    BATCHASR_HOST=0.0.0.0 \
    BATCHASR_PORT=8000 \
    BATCHASR_DEVICE=auto \
    BATCHASR_DTYPE=auto
# BATCHASR_MODEL is left unset: the embedded default model. Set it to a mounted .nemo to serve another.
USER 10001:10001
WORKDIR /home/batchasr
EXPOSE 8000
# Liveness only (the process answers); readiness (/readyz) is the orchestrator's business.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('BATCHASR_PORT', '8000'), timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["batchasr"]
CMD ["serve"]
