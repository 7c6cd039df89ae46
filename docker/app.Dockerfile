# tessera/app-cpu: the executors that run Tessera's code, `flower-superexec
# --plugin-type serverapp` (next to the SuperLink) and `--plugin-type clientapp` (next
# to each SuperNode). The app itself arrives as a FAB with each run; this image holds
# its dependencies: flwr, the CPU build of torch (no torchvision), numpy, scikit-learn,
# matplotlib, flwr-datasets. Multi-arch (amd64, arm64); see docker/README.md.
#
#   docker build -f docker/app.Dockerfile -t tessera/app-cpu .
#
# Build arguments: BASE_IMAGE, FLWR_VERSION, TORCH_VERSION, TORCH_INDEX_URL (where pip
# finds the CPU torch; default the PyTorch CPU index, which serves amd64 and arm64),
# WHEELHOUSE_URL (a folder of wheels served over HTTP, e.g. by scripts/docker-build.sh
# on 127.0.0.1 with `--network host`: pip then installs from it alone, no index).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG FLWR_VERSION=1.30.0
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WHEELHOUSE_URL=
LABEL org.opencontainers.image.title="tessera/app-cpu" \
      org.opencontainers.image.description="Tessera ServerApp/ClientApp executor (CPU torch)" \
      org.opencontainers.image.vendor="Tessera" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.flower.version="${FLWR_VERSION}" \
      org.pytorch.version="${TORCH_VERSION}"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY docker/requirements-app.txt /tmp/requirements-app.txt
# One layer: no pip cache, no compilers, no torch headers; fails if a CUDA torch or
# torchvision got in.
RUN if [ -n "$WHEELHOUSE_URL" ]; then src=(--no-index --find-links "$WHEELHOUSE_URL"); \
        torch_src=("${src[@]}"); \
    else src=(); torch_src=(--index-url "$TORCH_INDEX_URL"); fi \
 && python3 -m venv /opt/venv \
 && pip=(/opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check) \
 && "${pip[@]}" "${torch_src[@]}" "torch==${TORCH_VERSION}" \
 && "${pip[@]}" "${src[@]}" "flwr==${FLWR_VERSION}" "torch==${TORCH_VERSION}" \
        -r /tmp/requirements-app.txt \
 && { ! /opt/venv/bin/pip list --format=freeze | grep -Ei '^(nvidia-|torchvision=)' \
        || { echo "CUDA libraries or torchvision got in; use a CPU torch" >&2; exit 1; }; } \
 && rm -rf /opt/venv/lib/python3*/site-packages/torch/include /tmp/requirements-app.txt \
 && /opt/venv/bin/python -c "import torch, flwr, sklearn, flwr_datasets; \
print('torch', torch.__version__, 'flwr', flwr.__version__)" \
 && useradd --uid 1000 --user-group --create-home --home-dir /home/tessera --shell /bin/bash tessera \
 && mkdir -p /results /data \
 && chown tessera:tessera /results /data
# The ServerApp image (tessera/app-server: SERVER_EXTRAS=true) adds the ensemble's
# optimisers and numba in a layer of its own, so both images share the one above.
ARG SERVER_EXTRAS=false
COPY docker/requirements-server.txt /tmp/requirements-server.txt
RUN if [ "$SERVER_EXTRAS" = true ]; then \
        if [ -n "$WHEELHOUSE_URL" ]; then \
            export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE_URL"; \
        fi; \
        /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check \
            -r /tmp/requirements-server.txt \
     && /opt/venv/bin/python -c "import optuna, cmaes, pyswarms, smac, numba; \
print('optuna', optuna.__version__, 'numba', numba.__version__)"; \
    elif [ "$SERVER_EXTRAS" != false ]; then \
        echo "SERVER_EXTRAS is '$SERVER_EXTRAS'; use true or false" >&2; exit 1; \
    fi \
 && rm -f /tmp/requirements-server.txt
COPY docker/entrypoint.sh /usr/local/bin/tessera-entrypoint
COPY docker/healthcheck.py /usr/local/bin/tessera-healthcheck
# the warm ClientApp executor (`tessera-entrypoint clientapp`): one file, standard
# library and Flower only; the app's own code still comes from the FAB
COPY tessera/executor.py /usr/local/lib/tessera/executor.py
# Writable places for any user id (compose may run the ServerApp as the host user,
# TESSERA_UID, so that results in the mounted folder belong to them).
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
CMD ["--help"]
