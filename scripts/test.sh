#!/usr/bin/env bash
# Set up (first time) and run the whole test suite: unit tests, Flower simulation
# and real multi-process deployment tests (marked slow), plus ruff (lint and format), mypy
# and the docs site (mkdocs build --strict: a broken link or docstring fails).
#   scripts/test.sh [extra pytest arguments]   (with arguments: one pytest run of them)
# Environment: TESSERA_TEST_LANES=1 runs the whole suite in one pytest run.
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
# With arguments, or TESSERA_TEST_LANES=1: one pytest run, as given.
if [ $# -gt 0 ] || [ "${TESSERA_TEST_LANES:-2}" = 1 ]; then
    exec python -m pytest "$@"
fi
# The whole suite runs in two lanes at once (about 10 minutes less on two cores):
# the end-to-end tests (marked slow: Flower simulations, SuperLink/SuperNode
# processes, Ray) one after another in one lane, exactly as in a single run, and the
# unit and Docker tests in the other. The end-to-end lane's output goes to a log,
# shown (and followed) when the other lane ends. Ctrl-C stops both.
case "${TESSERA_TEST_LANES:-2}" in
    2) ;;
    *) echo "test.sh: TESSERA_TEST_LANES must be 1 (one run) or 2 (two lanes), got '$TESSERA_TEST_LANES'" >&2; exit 2 ;;
esac
logs="$(mktemp -d "${TMPDIR:-/tmp}/tessera-tests.XXXXXX")"
e2e_log="$logs/end-to-end.log"
set -m # the lane gets a process group of its own, and Ctrl-C is forwarded to it
python -m pytest -m "slow and not docker" -p no:cacheprovider >"$e2e_log" 2>&1 &
e2e=$!
set +m
stop_e2e() {
    kill -INT -- "-$e2e" 2>/dev/null || true
    wait "$e2e" 2>/dev/null || true
    tail -n 40 "$e2e_log"
    exit 130
}
trap stop_e2e INT TERM
echo "test.sh: the end-to-end tests run in a second lane; log: $e2e_log"
rc=0
python -m pytest -m "not slow or docker" || rc=$?
echo
echo "test.sh: unit and Docker tests exited with $rc; the end-to-end lane (so far, then as it goes):"
tail -n +1 -f --pid="$e2e" "$e2e_log" &
follow=$!
e2e_rc=0
wait "$e2e" || e2e_rc=$?
sleep 0.5
kill "$follow" 2>/dev/null || true
wait "$follow" 2>/dev/null || true
trap - INT TERM
echo "test.sh: unit and Docker tests exited with $rc, end-to-end tests with $e2e_rc (log: $e2e_log)"
[ "$rc" = 0 ] && [ "$e2e_rc" = 0 ]
