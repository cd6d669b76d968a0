# The image the KubeRay manifests in k8s/ run (rayhf/rayhf:0.1.0): Ray 2.60 with rayhf at /app.
#   docker build -t rayhf/rayhf:0.1.0 .
# Ray in the image must match rayVersion "2.60.0" in the manifests.
FROM rayproject/ray:2.60.0-py311-gpu
WORKDIR /app
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users rayhf ./rayhf
COPY --chown=ray:users examples ./examples
COPY --chown=ray:users deployments ./deployments
RUN pip install --no-cache-dir -e .
