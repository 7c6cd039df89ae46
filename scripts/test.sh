#!/usr/bin/env bash
# Set up (first time) and run the whole test suite: unit tests, Flower simulation
# and real multi-process deployment tests (marked slow), plus ruff (lint and format) and mypy.
#   scripts/test.sh [extra pytest arguments]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
# shellcheck source=scripts/flower-env.sh
source scripts/flower-env.sh
ruff check .
ruff format --check .
mypy server_app client_app strategies models tessera
python -m pytest "$@"
