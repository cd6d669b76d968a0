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
set +e
python -m pytest -q -p no:cacheprovider --durations=25 "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$code"
