# quantserve for a T4-class GPU host (compute capability 7.5 and newer).
#   docker build -t quantserve .
#   docker run --gpus all -p 8000:8000 -v $PWD/models:/models quantserve /models/gguf-q8_0
# The image serves a model from the mounted /models volume; see docker-compose.yml.

# ---- build: CUDA toolkit for llama.cpp's CUDA kernels --------------------------------------------
FROM nvidia/cuda:12.4.1-devel-ubuntu22.04 AS build
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch with CUDA 12.4 kernels (they include sm_75, the T4)
RUN pip install --no-cache-dir torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124
WORKDIR /src
COPY pyproject.toml README.md ./
COPY quantserve ./quantserve
COPY training ./training
COPY quant ./quant
COPY server ./server
COPY bench ./bench
# llama.cpp with CUDA for Turing (T4) and newer GPUs; the project itself is the local source
# hadolint ignore=DL3013
RUN CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=75;80;86;89;90" \
    pip install --no-cache-dir ".[quant]"

# ---- runtime: CUDA libraries only, non-root ----------------------------------------------------
FROM nvidia/cuda:12.4.1-runtime-ubuntu22.04
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
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
ENTRYPOINT ["quantserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["/models/model"]
