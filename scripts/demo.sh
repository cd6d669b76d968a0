#!/usr/bin/env bash
# Set up .venv and run the main job: PPO on a tiny Llama on an embedded local Ray cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
rayhf run examples/ppo_tiny.yaml "$@"
