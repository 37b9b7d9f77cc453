# CUDA image of the slotwise inference service (port 50052). Runs where the NVIDIA Container
# Toolkit provides the driver: `docker run --gpus all` or compose's GPU reservation.
#
#   docker build -f docker/infer.Dockerfile -t slotwise/infer:latest-cuda .
#   docker build -f docker/infer.Dockerfile --build-arg CUDA_ARCHITECTURES=90 ...   # H100/H200 only
#
# llama-cpp-python 0.3.36 (pinned in pyproject.toml) is compiled from source in the CUDA devel
# image with -DGGML_CUDA=on, and the virtualenv is copied into the much smaller CUDA runtime
# image. GGML_NATIVE=OFF is required: there is no GPU while building, so "native" cannot be
# detected. CUDA_ARCHITECTURES=default keeps llama.cpp's list (real code for 86/89, PTX for
# the others, JIT-compiled on first start); naming only the GPUs you run builds much faster.
# The CUDA version must be supported by the host's driver (12.8: driver >= 570).
# No model is downloaded or copied in: models are mounted at /models when the container runs.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04
# the base images (stand-ins where the registry is not reachable); the defaults are NVIDIA's
ARG BUILD_IMAGE=nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION}
ARG RUNTIME_IMAGE=nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}

FROM ${BUILD_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake python3 python3-dev python3-venv \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/slotwise
ENV PATH=/opt/slotwise/bin:$PATH
WORKDIR /src
# Dependencies first, read from pyproject.toml alone: a code change does not rebuild llama.cpp.
COPY pyproject.toml ./
ARG CUDA_ARCHITECTURES=default
ARG LLAMA_CMAKE_ARGS="-DGGML_CUDA=on -DGGML_NATIVE=OFF"
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *p['optional-dependencies']['serve'], sep=chr(10))" > requirements.txt \
 && if [ "${CUDA_ARCHITECTURES}" != "default" ]; then ARCHS="-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}"; fi \
 && CMAKE_ARGS="${LLAMA_CMAKE_ARGS} ${ARCHS:-}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    pip install --no-binary llama-cpp-python -r requirements.txt
COPY README.md ./
COPY protos/ protos/
COPY slotwise_core/ slotwise_core/
COPY prep_service/ prep_service/
COPY infer_service/ infer_service/
COPY clients/ clients/
COPY slotwise_serve/ slotwise_serve/
COPY model_router/ model_router/
COPY benchmarks/ benchmarks/
COPY slotwise_cli/ slotwise_cli/
RUN pip install --no-deps . && pip check

FROM ${RUNTIME_IMAGE} AS runtime
# python3: the interpreter the virtualenv links to; libgomp1: llama.cpp's CPU backend (OpenMP)
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin slotwise \
 && install -d -o slotwise -g slotwise /var/lib/slotwise/sessions
COPY --from=build /opt/slotwise /opt/slotwise
ENV PATH=/opt/slotwise/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/slotwise
EXPOSE 50052
CMD ["python", "-m", "infer_service", "--model", "/models/model.gguf", "--mmproj", "/models/mmproj.gguf", "--gpu-layers", "999", "--sessions-dir", "/var/lib/slotwise/sessions", "--port", "50052"]
