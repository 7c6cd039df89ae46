#!/usr/bin/env bash
# Set up (first time) and run a Tessera federation in Flower simulation, then print
# the per-round results table. Leaves no process behind.
#
#   scripts/simulate.sh [--nodes N] [--run-config "key=value ..."] [--run-name NAME]
#                       [--ray-address HOST:PORT] [--gpus-per-node G]
#
# Defaults: 6 simulated nodes emulating a mixed fleet (run-config
# sim-device-profiles), the scheme and data in pyproject.toml [tool.flwr.app.config].
# --ray-address: run the nodes on an existing Ray cluster (its head's GCS address,
# from `ray start --head`) instead of a Ray started for this run on this machine.
# --gpus-per-node: the share of a GPU Ray reserves for each node's ClientApp (0, the
# default, or a fraction such as 0.25 to run four nodes on one GPU at a time).
# Nodes probe their device (run-config sim-device-profiles='') to train on it.
# Environment: FLWR_HOME_SIM (Flower's home), SIMULATE_RETRY_WAIT (seconds, times the
# attempt, between start attempts; 10), TESSERA_FLWR (the flwr command; tests).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
NODES=6
RUN_CONFIG=""
RUN_NAME="sim-$(date +%Y%m%d-%H%M%S)"
RAY_CLUSTER=""
GPUS=0
OUTPUT_DIR="$ROOT/results"
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) NODES="$2"; shift 2 ;;
        --run-config) RUN_CONFIG="$2"; shift 2 ;;
        --run-name) RUN_NAME="$2"; shift 2 ;;
        --output-dir) OUTPUT_DIR="$2"; shift 2 ;;
        --ray-address) RAY_CLUSTER="$2"; shift 2 ;;
        --gpus-per-node) GPUS="$2"; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "simulate.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$NODES" in ''|*[!0-9]*) echo "simulate.sh: --nodes must be a positive integer, got '$NODES'" >&2; exit 2 ;; esac
case "$GPUS" in
    ''|*[!0-9.]*|*.*.*|.) echo "simulate.sh: --gpus-per-node must be a number such as 0, 0.25 or 1 (a share of one GPU per node), got '$GPUS'" >&2; exit 2 ;;
esac

case "$RAY_CLUSTER" in
    '') ;;
    *:*[!0-9]*|*:|:*|*[!A-Za-z0-9.:_-]*)
        echo "simulate.sh: --ray-address must be HOST:PORT of a Ray head's GCS (as printed by 'ray start --head'), got '$RAY_CLUSTER'" >&2; exit 2 ;;
    *:*) ;;
    *) echo "simulate.sh: --ray-address must be HOST:PORT of a Ray head's GCS (as printed by 'ray start --head'), got '$RAY_CLUSTER'" >&2; exit 2 ;;
esac

bash scripts/setup.sh
# A GPU share on a machine with none would leave every ClientApp waiting for Ray to
# schedule it: refuse it now (a Ray cluster may hold GPUs this machine lacks).
if [ -z "$RAY_CLUSTER" ] && [ "$(awk -v g="$GPUS" 'BEGIN { print (g > 0) }')" = 1 ]; then
    if ! .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.cuda.device_count() > 0 else 1)'; then
        echo "simulate.sh: --gpus-per-node $GPUS but torch sees no CUDA device on this machine; leave it out (or 0) to train on the CPU" >&2
        exit 2
    fi
fi
# shellcheck source=scripts/flower-env.sh
source scripts/flower-env.sh
export FLWR_HOME="${FLWR_HOME_SIM:-$ROOT/.flwr-home}"
mkdir -p "$FLWR_HOME"
FLWR_LOCAL_CONTROL_API_PORT="$(free_port)"
export FLWR_LOCAL_CONTROL_API_PORT
# `flwr run` builds the app from what it finds under the folder it is given: stage
# the publishable files in a folder of their own (tessera/app_stage.py; the same FAB,
# byte for byte) so that it does not walk .venv's 80,000 files (6-7 s) every run.
APP_DIR="$(mktemp -d "$FLWR_HOME/app.XXXXXX")"
trap 'stop_local_superlink "$FLWR_HOME"; rm -rf "$APP_DIR"' EXIT INT TERM
python -m tessera.app_stage "$ROOT" "$APP_DIR" >/dev/null
# Flower's Ray backend calls ray.init() in flwr-simulation, which the SuperLink
# starts with this environment: RAY_ADDRESS makes it join that cluster (and leave
# it running at the end) instead of starting a Ray of its own.
if [ -n "$RAY_CLUSTER" ]; then
    export RAY_ADDRESS="$RAY_CLUSTER"
    echo "simulate.sh: the nodes run on the Ray cluster at $RAY_CLUSTER"
else
    unset RAY_ADDRESS
fi

LOG="$FLWR_HOME/$RUN_NAME.log"
run_flower() {
    set +e
    "${TESSERA_FLWR:-flwr}" run "$APP_DIR" --stream \
        --federation-config "num-supernodes=$NODES client-resources-num-cpus=1 client-resources-num-gpus=$GPUS" \
        --run-config "$RUN_CONFIG output-dir='$OUTPUT_DIR' run-name='$RUN_NAME'" 2>&1 | tee "$LOG"
    set -e
}
# Ray occasionally fails to bring its raylet up within its fixed 30 s ("The current
# node timed out during startup"), seen on busy and on idle 2-core machines alike.
# That is a start-up failure before any round ran: retry (up to 6 attempts, waiting
# 10, 20, 30, 40, 50 s between them: a GCS that would not start stayed so for 2.5
# minutes once, then came up), and say so with the machine's state. A resumed run
# already has rounds in its folder: what counts is whether this attempt added one,
# and a retry puts the folder back as it was before the first attempt.
METRICS="$OUTPUT_DIR/$RUN_NAME/metrics.jsonl"
metrics_lines() { if [ -f "$METRICS" ]; then wc -l < "$METRICS"; else echo 0; fi; }
ray_start_failed() {
    [ "$(metrics_lines)" -le "$LINES_BEFORE" ] \
        && grep -qE "timed out during startup|logs/gcs_server.err" "$LOG" \
        && ! grep -q "ServerApp thread raised an exception" "$LOG"
}
# What the machine looked like when Ray would not start, so a failure says why.
ray_start_diagnostics() {
    {
        echo "simulate.sh: machine state after Ray failed to start:"
        echo "  load: $(cut -d' ' -f1-3 /proc/loadavg)"
        echo "  memory: $(free -m | awk '/Mem:/ {print $7 " MiB available of " $2}')"
        echo "  /tmp: $(df -h /tmp | awk 'NR==2 {print $4 " free"}'), /dev/shm: $(df -h /dev/shm | awk 'NR==2 {print $4 " free"}')"
        echo "  ray processes still alive: $(pgrep -fc 'gcs_server|raylet|ray::' || true)"
        local session
        session="$(grep -oE '/tmp/ray/session_[0-9_-]+' "$LOG" | tail -1 || true)"
        if [ -n "$session" ] && [ -d "$session/logs" ]; then
            echo "  $session/logs: $(ls "$session/logs" | tr '\n' ' ')"
            tail -n 5 "$session"/logs/gcs_server*.out 2>/dev/null | sed 's/^/    /' || true
        fi
    } >&2
}
# Give the GCS a minute to answer (Ray's default is 20 one-second tries).
export RAY_NUM_REDIS_GET_RETRIES="${RAY_NUM_REDIS_GET_RETRIES:-60}"
LINES_BEFORE="$(metrics_lines)"
BEFORE="$FLWR_HOME/$RUN_NAME.before"
rm -rf "$BEFORE"
if [ -d "$OUTPUT_DIR/$RUN_NAME" ]; then cp -a "$OUTPUT_DIR/$RUN_NAME" "$BEFORE"; fi
ATTEMPTS=6
for attempt in $(seq 1 "$ATTEMPTS"); do
    run_flower
    if [ "$attempt" -lt "$ATTEMPTS" ] && ray_start_failed; then
        echo "simulate.sh: Ray failed to start (attempt $attempt of $ATTEMPTS); retrying the run" >&2
        ray_start_diagnostics
        stop_local_superlink "$FLWR_HOME"
        rm -rf "${OUTPUT_DIR:?}/$RUN_NAME"
        if [ -d "$BEFORE" ]; then cp -a "$BEFORE" "$OUTPUT_DIR/$RUN_NAME"; fi
        FLWR_LOCAL_CONTROL_API_PORT="$(free_port)"
        sleep $((attempt * ${SIMULATE_RETRY_WAIT:-10}))
        continue
    fi
    break
done
rm -rf "$BEFORE"
if ray_start_failed; then
    echo "simulate.sh: Ray failed to start in $ATTEMPTS attempts; no round ran; see $LOG" >&2
    ray_start_diagnostics
    exit 1
fi
python -m tessera.report "$OUTPUT_DIR/$RUN_NAME"
