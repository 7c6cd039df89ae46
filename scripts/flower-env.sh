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
    local home roots tree pid child alive
    home="$(printf '%s' "$1" | sed 's/[][\\.*^$+?(){}|]/\\&/g')"
    roots="$(pgrep -f "flower-superlink.*${home}" || true)"
    # Collect the whole tree before anything dies (a dying parent's children are
    # re-parented and lost): the SuperLink, what it launched (flwr-simulation and
    # flwr-serverapp name it with --parent-pid, possibly in sessions of their own)
    # and their descendants (Ray's GCS, raylet and workers).
    tree=""
    for pid in $roots; do
        tree="$tree $pid $(process_tree "$pid")"
        for child in $(pgrep -f -- "--parent-pid $pid( |$)" || true); do
            tree="$tree $child $(process_tree "$child")"
        done
    done
    for pid in $roots; do
        kill -TERM -- "-$pid" 2>/dev/null || true
    done
    for pid in $tree; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    # A graceful exit gets 5 s (a loaded machine included); then whatever is left of
    # the tree, and anything still naming the folder, is killed.
    for _ in $(seq 1 20); do
        alive=""
        for pid in $tree; do
            if kill -0 "$pid" 2>/dev/null; then alive="$alive $pid"; fi
        done
        [ -z "$alive" ] && [ -z "$(naming "$home")" ] && break
        sleep 0.25
    done
    for pid in $tree; do
        kill -KILL "$pid" 2>/dev/null || true
    done
    for pid in $(naming "$home"); do
        kill -KILL "$pid" 2>/dev/null || true
    done
}

# Print the processes whose command line matches $1, this shell and its parent aside.
naming() {
    local pid
    for pid in $(pgrep -f "$1" || true); do
        [ "$pid" = "$$" ] || [ "$pid" = "$BASHPID" ] || [ "$pid" = "$PPID" ] || echo "$pid"
    done
}

# Print the descendants of process $1 (children first, then theirs), one per line.
process_tree() {
    local child
    for child in $(pgrep -P "$1" || true); do
        echo "$child"
        process_tree "$child"
    done
}
