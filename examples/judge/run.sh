#!/usr/bin/env bash
# The judge example on this machine: a briefly fine-tuned policy to start GRPO from, the judge's
# base model (an echo LM), the judge fine-tuned from it by SFT, the plan (the judge's generate
# call and the reallocations), GRPO rewarded by the judge's verdicts, then a report of the true
# reward beside the judge's. Run from anywhere after `bash scripts/setup.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
rm -rf runs/judge
rayhf sft examples/pipeline/sft.yaml run_dir=runs/judge/policy steps=150 save_every=150
rayhf sft examples/judge/reader.yaml
rayhf sft examples/judge/sft.yaml
rayhf plan examples/judge/grpo.yaml
rayhf run examples/judge/grpo.yaml
python examples/judge/report.py runs/judge
