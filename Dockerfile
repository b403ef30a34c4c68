# quantserve for a T4-class GPU host (compute capability 7.5 and newer).
#   docker build -t quantserve .
#   docker run --gpus all -p 8000:8000 -v $PWD/models:/models quantserve /models/gguf-q8_0
# The image serves a model from the mounted /models volume; see docker-compose.yml.

# ---- build: CUDA toolkit for llama.cpp's CUDA kernels --------------------------------------------
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04 AS build
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch with CUDA 12.8 kernels (they include sm_75, the T4; transformers 5 needs torch >= 2.6), then
# the locked set 'make test' runs with, then the project itself without resolving again
ARG TORCH_VERSION=2.13.0
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cu128
WORKDIR /src
COPY requirements-docker.txt pyproject.toml README.md ./
COPY quantserve ./quantserve
COPY training ./training
COPY quant ./quant
COPY server ./server
COPY bench ./bench
# llama.cpp with CUDA for Turing (T4) and newer GPUs; the project itself is the local source
# hadolint ignore=DL3013
RUN CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=75;80;86;89;90" \
    pip install --no-cache-dir -r requirements-docker.txt \
    && pip install --no-cache-dir --no-deps .

# ---- runtime: CUDA libraries only, non-root ----------------------------------------------------
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --create-home --uid 1000 quantserve
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    QUANTSERVE_HOME=/home/quantserve/.cache/quantserve \
    QUANTSERVE_GPU_PROFILE=t4
USER 1000
WORKDIR /home/quantserve
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# The served name is "model" unless MODEL_NAME says otherwise; the path is the CMD.
ENV MODEL_NAME=model
ENTRYPOINT ["sh", "-c", "exec quantserve serve --host 0.0.0.0 --port 8000 --served-model-name \"$MODEL_NAME\" \"$@\"", "quantserve"]
CMD ["/models/model"]
