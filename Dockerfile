# tandem: one image for every service (`tandem verifier`, `tandem drafter`, `tandem gateway`).
#
#   docker build -t tandem:latest .
#   docker run --rm -p 50052:50052 tandem:latest drafter
#
# Everything comes from PyPI and Debian's packages; nothing else is fetched at build time.
#
# TORCH_SPEC is the pip requirement used for torch, installed before the project so that
# `pip install .` keeps it. The default, PyPI's `torch`, is the CUDA build on Linux x86_64:
# the GPU profile of compose.yaml and CUDA nodes use it as is, and it runs on CPU too. For a
# smaller CPU-only image pass a CPU wheel spec that your pip index serves, e.g.
#   docker build --build-arg TORCH_SPEC='torch==2.13.0+cpu' -t tandem:cpu .

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: a virtual environment with torch and tandem ---------------------------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_SPEC=torch
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# gcc compiles the native modules at `pip install .` (setup.py: the global suffix index's table,
# the CPU step's kernels); the runtime stage needs only the compiled modules (libc).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, in its own layer: it is by far the largest dependency and changes rarely.
RUN pip install "${TORCH_SPEC}"
WORKDIR /src
# setup.py generates the protobuf/gRPC modules from protos/ during `pip install .`
# (grpcio-tools comes from PyPI through the build requirements of pyproject.toml).
COPY pyproject.toml setup.py README.md ./
COPY protos/ protos/
COPY kernels/ kernels/
COPY shared/ shared/
COPY verifier_service/ verifier_service/
COPY drafter_service/ drafter_service/
COPY gateway_service/ gateway_service/
# Check from outside /src that the installed package (generated modules, the compiled index and
# every service's subpackages included) imports.
RUN pip install . && cd / && tandem protocol \
    && python -c "import drafter_service.proposers._context_table, drafter_service.server, verifier_service.server, gateway_service.server"
# The embedded demo model (models/tandem-demo-moe), readable by the unprivileged user.
COPY models/ /opt/tandem/models/
RUN chmod -R a+rX /opt/tandem/models

# --- runtime --------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/tandem tandem
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/tandem /opt/tandem
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TANDEM_MODELS_DIR=/opt/tandem/models \
    TANDEM_VERIFIER_HOST=0.0.0.0 \
    TANDEM_DRAFTER_HOST=0.0.0.0 \
    TANDEM_GATEWAY_HOST=0.0.0.0
USER 10001
WORKDIR /home/tandem
# gRPC: verifier 50051, drafter 50052. Prometheus /metrics (when METRICS_PORT is set, as in
# compose.yaml and deploy/k8s): verifier 9091, drafter 9092. HTTP: the gateway's OpenAI API
# (and its /metrics) on 8000.
EXPOSE 50051 50052 9091 9092 8000
ENTRYPOINT ["tandem"]
CMD ["--help"]
