#!/usr/bin/env bash
# Run the README's demo (the main job, as `bash scripts/simulate.sh` runs it) and write
# its reproducible part into README.md's demo block. tests/test_simulation.py runs the
# same job and fails when the block no longer matches, naming this script.
#   scripts/readme-demo.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
bash scripts/simulate.sh --run-name readme-demo --output-dir "$OUT"
.venv/bin/python -m tessera.report --readme "$OUT/readme-demo" --write README.md
