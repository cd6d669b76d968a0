#!/usr/bin/env bash
# rayhf on a bare GPU machine that has torch (a CUDA build), transformers, pyarrow, typer and rich
# but no Ray or pydantic, and no network (the lent H100/H200 machines: docs/benchmarks/gpu.md).
#
#   here (with network):  bash scripts/gpu_env.sh pack
#       writes .gpuenv/ (ignored by git, about 37 MB): Ray 2.60's unpacked tree without ray/jars
#       and ray/rllib as one tar.xz (the wheel itself, 79 MB, is over what a call can carry) and
#       the wheels of the other missing packages, for CPython 3.12 on x86-64.
#   there (.gpuenv carried beside the checkout):  source scripts/gpu_env.sh install
#       unpacks them into /tmp/site, puts it and the checkout on PYTHONPATH (Ray's workers inherit
#       it) and a `rayhf` command on PATH; then `rayhf run ... cluster.device=cuda` works.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 1 2>/dev/null || exit 1
ENV_DIR=.gpuenv
RAY_VERSION=2.60.0
# what the image lacks, pinned to the versions the CPU suite runs with
WHEELS=(pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
        rapidfuzz==3.14.6 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
        referencing==0.37.0 rpds-py==2026.9.1
        fla-core==0.6.0)  # flash-linear-attention's kernels (Triton; the image has triton)

pack() (
  set -euo pipefail
  local pip="${PIP:-python3 -m pip}" tmp
  local platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
                   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  tmp=$(mktemp -d)
  rm -rf "$ENV_DIR" && mkdir -p "$ENV_DIR"
  $pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$tmp" "ray==$RAY_VERSION" "${WHEELS[@]}"
  mv "$tmp"/*.whl "$ENV_DIR"/
  mkdir "$tmp/tree" && unzip -q -d "$tmp/tree" "$ENV_DIR"/ray-*.whl
  rm -rf "$tmp/tree/ray/jars" "$tmp/tree/ray/rllib" "$ENV_DIR"/ray-*.whl
  tar -C "$tmp/tree" -cf - . | xz -T0 -6 >"$ENV_DIR/ray-$RAY_VERSION-tree.tar.xz"
  rm -rf "$tmp"
  du -sh "$ENV_DIR"
)

install() {
  local site=/tmp/site
  (
    set -euo pipefail
    mkdir -p "$site/bin"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$ENV_DIR"/*.whl
    tar -C "$site" -xJf "$ENV_DIR/ray-$RAY_VERSION-tree.tar.xz"
    printf '#!/bin/sh\nexec python3 -m rayhf "$@"\n' >"$site/bin/rayhf"
    chmod +x "$site/bin/rayhf"
  ) || return 1
  export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
  python3 -c "import rayhf, ray, torch; print(f'rayhf {rayhf.__version__}, ray {ray.__version__},' \
    f' torch {torch.__version__}, {torch.cuda.get_device_name(0)}')"
}

case "${1:-}" in
  pack) pack ;;
  install) install ;;
  *) echo "usage: bash scripts/gpu_env.sh pack | source scripts/gpu_env.sh install" >&2
     return 2 2>/dev/null || exit 2 ;;
esac
