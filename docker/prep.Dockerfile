# CPU images of slotwise, from one build stage:
#   target prep (the default, last stage): the preparation service, port 50051
#   target infer-cpu: the inference service for hosts without a GPU, port 50052 (compose.cpu.yaml)
#
#   docker build -f docker/prep.Dockerfile -t slotwise/prep .
#   docker build -f docker/prep.Dockerfile --target infer-cpu -t slotwise/infer:latest-cpu .
#
# llama-cpp-python 0.3.36 is compiled from source (pinned in pyproject.toml). GGML_NATIVE=OFF
# targets any x86-64 CPU with AVX2 rather than the build host's; to tune for the host that builds
# and runs the image: --build-arg LLAMA_CMAKE_ARGS="-DGGML_NATIVE=ON". A wheel of that version
# put in docker/wheels/ (one built for this Python and CPU, e.g. pip's on the build host) is
# installed instead: the build then takes minutes (tests/compose_up.sh does so).
# The base image is a build argument (PYTHON_IMAGE; compose: SLOTWISE_PYTHON_IMAGE): a Debian
# bookworm with python3, python3-venv and python-is-python3 stands in where Docker Hub is not
# reachable.
# No model is downloaded or copied in: models are mounted at /models when the container runs.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
COPY docker/wheels/ /wheels/
RUN if ! ls /wheels/llama_cpp_python-*.whl >/dev/null 2>&1; then \
      apt-get update \
      && apt-get install -y --no-install-recommends build-essential cmake \
      && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/slotwise
ENV PATH=/opt/slotwise/bin:$PATH
WORKDIR /src
# Dependencies first, read from pyproject.toml alone: a code change does not rebuild llama.cpp.
COPY pyproject.toml ./
ARG LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF"
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *p['optional-dependencies']['serve'], sep=chr(10))" > requirements.txt \
 && if ls /wheels/llama_cpp_python-*.whl >/dev/null 2>&1; then \
      echo "llama-cpp-python from the given wheel: $(ls /wheels/llama_cpp_python-*.whl)"; \
      pip install /wheels/llama_cpp_python-*.whl -r requirements.txt; \
    else \
      CMAKE_ARGS="${LLAMA_CMAKE_ARGS}" pip install --no-binary llama-cpp-python -r requirements.txt; \
    fi
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

FROM ${PYTHON_IMAGE} AS runtime
# libgomp1: llama.cpp's CPU backend uses OpenMP
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin slotwise \
 && install -d -o slotwise -g slotwise /var/lib/slotwise/sessions
COPY --from=build /opt/slotwise /opt/slotwise
ENV PATH=/opt/slotwise/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/slotwise

FROM runtime AS infer-cpu
EXPOSE 50052
CMD ["python", "-m", "infer_service", "--model", "/models/model.gguf", "--mmproj", "/models/mmproj.gguf", "--gpu-layers", "0", "--sessions-dir", "/var/lib/slotwise/sessions", "--port", "50052"]

FROM runtime AS prep
EXPOSE 50051
CMD ["python", "-m", "prep_service", "--model", "/models/model.gguf", "--mmproj", "/models/mmproj.gguf", "--port", "50051"]
