#!/usr/bin/env bash
# The whole RLHF pipeline on this machine: SFT -> reward model -> PPO with the learned reward
# model -> serve the PPO policy and ask it for a completion. Run from the repository root
# after `bash scripts/setup.sh` (or from anywhere: it changes to the root).
set -euo pipefail
cd "$(dirname "$0")/../.."
. .venv/bin/activate
rm -rf runs/pipeline
rayhf sft examples/pipeline/sft.yaml
rayhf rm examples/pipeline/rm.yaml
rayhf run examples/pipeline/ppo.yaml
python examples/pipeline/report.py runs/pipeline

port=${PORT:-8011}
rayhf serve runs/pipeline/ppo/checkpoints/step_000300/actor --port "$port" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -fsS "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1 && break
  sleep 1
done
curl -fsS "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "3 1 4 1 5 =", "max_tokens": 12, "temperature": 0}'
echo
