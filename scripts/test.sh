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
# The quick tests (not `slow`: single-threaded, no Ray runs) on both cores at once; then the
# slow ones (Ray runs, rayhf processes, the harnesses, whose time bounds need the cores) one at a
# time. Each pytest takes the same arguments; 5 is "collected nothing".
set +e
python -m pytest -q -p no:cacheprovider --durations=25 -n 2 -m "not slow" "$@"
quick=$?
python -m pytest -q -p no:cacheprovider --durations=25 -m slow "$@"
slow=$?
set -e
if [ "$quick" -eq 5 ] && [ "$slow" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
for code in "$quick" "$slow"; do
  if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then
    exit "$code"
  fi
done
