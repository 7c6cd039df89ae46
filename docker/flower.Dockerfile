# tessera/flower: Flower's SuperLink and SuperNode (started through tessera/supernode.py,
# which paces its pulls), and the one-shot services of the
# compose cluster (init: certificates and node keys; register: SuperNode keys; run:
# `flwr run` of the app, which it reads from a mounted checkout).
#
#   docker build -f docker/flower.Dockerfile -t tessera/flower .
#
# Build arguments: BASE_IMAGE (any Debian-like image with python3 >= 3.10, python3-venv
# and useradd; default the official python image), FLWR_VERSION, WHEELHOUSE_URL (a
# folder of wheels served over HTTP, e.g. by scripts/docker-build.sh on 127.0.0.1 with
# `--network host`: pip then installs from it alone, no index).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG FLWR_VERSION=1.30.0
ARG WHEELHOUSE_URL=
LABEL org.opencontainers.image.title="tessera/flower" \
      org.opencontainers.image.description="Flower SuperLink/SuperNode for Tessera" \
      org.opencontainers.image.vendor="Tessera" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.flower.version="${FLWR_VERSION}"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY docker/requirements-app.txt /tmp/constraints.txt
# constraints: the same numpy as the app image. No pip cache, no compilers.
RUN src=(); if [ -n "$WHEELHOUSE_URL" ]; then src=(--no-index --find-links "$WHEELHOUSE_URL"); fi \
 && python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check "${src[@]}" \
        -c /tmp/constraints.txt "flwr==${FLWR_VERSION}" \
 && /opt/venv/bin/flower-superlink --version \
 && rm -f /tmp/constraints.txt \
 && useradd --uid 1000 --user-group --create-home --home-dir /home/tessera --shell /bin/bash tessera \
 && mkdir -p /data /certs /tls /results /app /opt/tessera/scripts \
 && chown tessera:tessera /data /certs /tls /results
COPY scripts/lib.sh scripts/gen-certs.sh /opt/tessera/scripts/
COPY docker/entrypoint.sh /usr/local/bin/tessera-entrypoint
COPY docker/healthcheck.py /usr/local/bin/tessera-healthcheck
# Flower's SuperNode with paced pulls (stdlib and Flower only; tessera-entrypoint supernode)
COPY tessera/supernode.py /usr/local/lib/tessera/supernode.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    FLWR_HOME=/tmp/flwr-home \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    GEN_CERTS_BACKEND=python
USER 1000:1000
WORKDIR /home/tessera
# ServerAppIo, Fleet (gRPC-rere), Control; SuperNode ClientAppIo.
EXPOSE 9091 9092 9093 9094
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["tessera-healthcheck"]
ENTRYPOINT ["tessera-entrypoint"]
CMD ["--help"]
