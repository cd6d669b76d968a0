#!/usr/bin/env bash
# Multi-turn tool-use RL end to end on this machine: a tokenizer made here, a small Qwen2 taught
# the calculator's tool format by SFT, then GRPO through the calculator environment. Run from
# anywhere after `bash scripts/setup.sh`; arguments go to both stages as overrides.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
rm -rf runs/calculator
python -c "from rayhf.tasks.calculator import build_tokenizer as b; b('runs/calculator/tokenizer')"
rayhf sft examples/calculator/sft.yaml "$@"
rayhf run examples/calculator/grpo.yaml "$@"
