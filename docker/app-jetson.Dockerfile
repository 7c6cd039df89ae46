# tessera/app-jetson: the ClientApp executor for NVIDIA Jetson (JetPack 6 / L4T r36,
# Ubuntu 22.04, Python 3.10, arm64). torch with CUDA comes from the base image; this
# image adds flwr and the app's other dependencies without letting pip replace torch
# or numpy (a constraints file pins them to the base's versions, and the build fails
# if either changed). Build and run it on the Jetson (see docker/README.md):
#
#   docker build -f docker/app-jetson.Dockerfile -t tessera/app-jetson .
#   docker run --rm --runtime nvidia tessera/app-jetson python3 -c \
#       "import torch; print(torch.cuda.is_available())"
#
# Build arguments: BASE_IMAGE (an L4T PyTorch image matching the device's L4T release,
# e.g. dustynv/l4t-pytorch:r36.4.0 or nvcr.io/nvidia/pytorch:24.12-py3-igpu),
# FLWR_VERSION, PIP_INDEX_URL (the jetson-containers images point pip at their own
# index; default PyPI), WHEELHOUSE_URL (a folder of cp310 aarch64 wheels served over
# HTTP, for a device without PyPI: pip installs from it alone).
ARG BASE_IMAGE=dustynv/l4t-pytorch:r36.4.0
FROM ${BASE_IMAGE}
ARG FLWR_VERSION=1.30.0
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG WHEELHOUSE_URL=
LABEL org.opencontainers.image.title="tessera/app-jetson" \
      org.opencontainers.image.description="Tessera ClientApp executor for Jetson (JetPack 6, CUDA torch)" \
      org.opencontainers.image.vendor="Tessera" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.flower.version="${FLWR_VERSION}"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY docker/requirements-jetson.txt /tmp/requirements-jetson.txt
# The base's torch must be a CUDA build for Python 3.10; the venv sees it through
# --system-site-packages.
RUN python3 -c "import sys, torch; assert sys.version_info[:2] == (3, 10), sys.version; \
assert torch.version.cuda, 'BASE_IMAGE has a CPU-only torch; use an L4T PyTorch image'" \
 && python3 -c "from importlib.metadata import version as v; \
print(f'torch=={v(\"torch\")}'); print(f'numpy=={v(\"numpy\")}')" > /tmp/base-pins.txt \
 && if [ -n "$WHEELHOUSE_URL" ]; then src=(--no-index --find-links "$WHEELHOUSE_URL"); \
    else src=(--index-url "$PIP_INDEX_URL"); fi \
 && python3 -m venv --system-site-packages /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check "${src[@]}" \
        -c /tmp/base-pins.txt "flwr==${FLWR_VERSION}" -r /tmp/requirements-jetson.txt \
 && /opt/venv/bin/python -c "from importlib.metadata import version as v; \
pins = dict(l.strip().split('==') for l in open('/tmp/base-pins.txt')); \
now = {k: v(k) for k in pins}; assert now == pins, f'pip changed {pins} to {now}'" \
 && rm -rf /tmp/requirements-jetson.txt /root/.cache \
 && useradd --uid 1000 --user-group --create-home --home-dir /home/tessera --shell /bin/bash tessera \
 && usermod --append --groups video tessera \
 && mkdir -p /results /data \
 && chown tessera:tessera /results /data
COPY docker/entrypoint.sh /usr/local/bin/tessera-entrypoint
COPY docker/healthcheck.py /usr/local/bin/tessera-healthcheck
# the warm ClientApp executor (`tessera-entrypoint clientapp`): one file, standard
# library and Flower only; the app's own code still comes from the FAB
COPY tessera/executor.py /usr/local/lib/tessera/executor.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    FLWR_HOME=/tmp/flwr-home \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    HF_HOME=/tmp/huggingface
USER 1000:1000
WORKDIR /home/tessera
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["tessera-healthcheck"]
ENTRYPOINT ["tessera-entrypoint"]
CMD ["clientapp"]
