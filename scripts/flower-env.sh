# Sourced by the run scripts: offline Flower settings and an isolated FLWR_HOME.
# shellcheck shell=bash
ROOT="${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
export PATH="$ROOT/.venv/bin:$PATH"
# Never let `flwr run` pip-install the app's dependencies into a fresh environment.
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_DISABLE_UPDATE_CHECK=1
export RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::FutureWarning,ignore::DeprecationWarning}"

free_port() {
    "$ROOT/.venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# Stop the local SuperLink that `flwr run` starts in the background for simulation
# (it outlives the command), with everything it spawned.
# pgrep/pkill read a pattern as a regular expression: escape the folder's name
# (a run name such as 'ensemble[learning-rate=0.05]--iid' holds brackets).
stop_local_superlink() {
    local home pids pid
    home="$(printf '%s' "$1" | sed 's/[][\\.*^$+?(){}|]/\\&/g')"
    pids="$(pgrep -f "flower-superlink.*${home}" || true)"
    for pid in $pids; do
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    done
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        pgrep -f "$home" >/dev/null || break
        sleep 0.5
    done
    pkill -KILL -f "$home" 2>/dev/null || true
}
