#!/usr/bin/env bash
# Set up .venv, then lint, type-check and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
RAYHF_ENGINES=1 bash scripts/setup.sh  # with the CPU engines (vLLM) the tests run for real
. .venv/bin/activate
export RAYHF_REQUIRE_ENGINES=1  # the engine tests must run, not skip
export RAYHF_REQUIRE_SANDBOX=1  # and the sandbox tests: the code tool holds here
ruff check rayhf tests examples benchmarks
ruff format --check rayhf tests examples benchmarks
mypy
# Three pytest runs, each with the same arguments: the quick tests (not `slow`: no Ray runs) on
# both cores, test by test; the slow ones (Ray runs, rayhf processes, the harnesses) on both
# cores too, a file at a time on a worker (its module fixtures, a harness's subprocess or a
# server, made once), in the order collected (tests/conftest.py: the longest files first); last
# the slow ones marked `alone`, whose wall-clock bounds need the cores to themselves, one at a
# time. 5 is "collected nothing".
codes=()
run_pytest() {  # the arguments every run shares, then its own; its exit code goes to `codes`
  python -m pytest -q -p no:cacheprovider --durations=25 "$@"
  codes+=("$?")
}
set +e
run_pytest -n 2 -m "not slow" "$@"
run_pytest -n 2 --dist loadfile --no-loadscope-reorder -m "slow and not alone" "$@"
run_pytest -m "slow and alone" "$@"
set -e
if [ "${codes[*]}" = "5 5 5" ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
for code in "${codes[@]}"; do
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then
    exit "$code"
  fi
done
