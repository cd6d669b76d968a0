#!/usr/bin/env bash
# GSM8K-format GRPO end to end on this machine: a BPE tokenizer and arithmetic word problems made
# here, a small Qwen3 taught the answer format by SFT (the "instruct model"), then GRPO with the
# exact-answer reward. Run from anywhere after `bash scripts/setup.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
rm -rf runs/gsm8k
python -c "from rayhf.tasks.arithmetic import build_tokenizer; build_tokenizer('runs/gsm8k/tokenizer')"
rayhf sft examples/gsm8k/sft.yaml "$@"
rayhf run examples/gsm8k_grpo.yaml "$@"
