#!/usr/bin/env bash
# Set up .venv and run the main job on an embedded local Ray cluster, 2 emulated CPU devices:
# a tiny Llama, from scratch, learns to reverse digits ("3 1 4 =" -> "4 1 3"): 120 steps of SFT
# on demonstrations, then 300 PPO steps against a reward no shortcut can game
# (rayhf.tasks.reverse). Arguments go to the PPO stage as overrides (e.g. steps=400 seed=2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
rm -rf runs/demo   # the demo's own directory: each demo starts from scratch
rayhf run examples/demo/sft.yaml
rayhf run examples/demo/ppo.yaml "$@"
python -m rayhf.tasks.reverse runs/demo/ppo
