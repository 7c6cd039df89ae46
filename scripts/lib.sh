# shellcheck shell=bash
# Shared helpers for the scripts in scripts/. Source it; do not execute it.
#
#   . "$(dirname "$0")/lib.sh"
#
# Needs bash (arrays, [[ ]]); nothing else beyond POSIX tools.

# Repository root (the folder that holds pyproject.toml).
TESSERA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TESSERA_ROOT

# Prefix for messages; the sourcing script may override it.
: "${LOG_PREFIX:=tessera}"

log() { printf '[%s] %s\n' "$LOG_PREFIX" "$*" >&2; }
warn() { printf '[%s] warning: %s\n' "$LOG_PREFIX" "$*" >&2; }
die() {
    printf '[%s] error: %s\n' "$LOG_PREFIX" "$*" >&2
    exit 1
}

# have CMD: true when CMD is on PATH.
have() { command -v "$1" >/dev/null 2>&1; }

# abs_path PATH: PATH made absolute against $PWD (the path need not exist).
abs_path() {
    case "$1" in
        /*) printf '%s\n' "$1" ;;
        *) printf '%s/%s\n' "$PWD" "${1#./}" ;;
    esac
}

# tessera_python: the project's interpreter (.venv first, then python3).
tessera_python() {
    if [ -x "$TESSERA_ROOT/.venv/bin/python" ]; then
        printf '%s\n' "$TESSERA_ROOT/.venv/bin/python"
    elif have python3; then
        command -v python3
    else
        return 1
    fi
}

# is_ip NAME: true for an IPv4 or IPv6 address literal (anything with a colon
# counts as IPv6; host names never contain one).
is_ip() {
    case "$1" in
        *:*) return 0 ;;
    esac
    printf '%s\n' "$1" | grep -Eq '^[0-9]{1,3}(\.[0-9]{1,3}){3}$'
}

# tail_log FILE [LINES]: print the end of a log file with a header, to stderr.
tail_log() {
    local file="$1" lines="${2:-40}"
    [ -f "$file" ] || return 0
    printf '\n----- last %s lines of %s -----\n' "$lines" "$file" >&2
    tail -n "$lines" "$file" >&2 || true
}
