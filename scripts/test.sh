#!/usr/bin/env bash
# Set up (first time) and run the whole test suite: unit tests, Flower simulation
# and real multi-process deployment tests (marked slow), plus ruff (lint and format), mypy
# and the docs site (mkdocs build --strict: a broken link or docstring fails).
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
SITE="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 mkdocs build --quiet --strict -f docs/mkdocs.yml -d "$SITE"
rm -rf "$SITE"
python -m pytest "$@"
