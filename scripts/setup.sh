#!/usr/bin/env bash
# Create .venv/ in the repository root and install Tessera with its pinned
# dependencies (Flower 1.30.0, torch 2.14.1, ...). Idempotent: does nothing when
# pyproject.toml has not changed since the last successful install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"

if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
    echo "setup: Tessera needs Python >= 3.10; $PYTHON is $("$PYTHON" --version 2>&1)." >&2
    echo "setup: set PYTHON=/path/to/python3.10+ and run again." >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.tessera-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "setup: installing dependencies into .venv (first run takes a few minutes)"
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[dev,ensemble,docs]"
echo "$want" > "$stamp"
echo "setup: done ($(.venv/bin/python -c 'import flwr, torch; print(f"flwr {flwr.__version__}, torch {torch.__version__}")'))"
