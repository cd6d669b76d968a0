#!/usr/bin/env bash
# The judge example on this machine: train a judge for the demo task by SFT, show its plan
# (the judge's generate call and the reallocations), run GRPO rewarded by its verdicts, then
# report the true reward beside the judge's. Run from anywhere after `bash scripts/setup.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
rm -rf runs/judge
rayhf sft examples/judge/sft.yaml
rayhf plan examples/judge/grpo.yaml
rayhf run examples/judge/grpo.yaml
python examples/judge/report.py runs/judge
