#!/usr/bin/env bash
# Builds the S3-compatible server the model delivery tests fetch from (versitygw, Apache-2.0,
# a gateway that serves a POSIX directory over the S3 API with real SigV4 authentication) from
# the Go module proxy into a cache outside the repository, keyed by version:
#
#   ${DAVIT_CACHE:-$HOME/.cache/davit}/s3server/<version>/versitygw
#
# The wrapper module beside this script pins every dependency (go.sum; built read-only, so a
# build never rewrites them). Idempotent: a present binary whose stamp names the same version
# and go.sum is kept (under a second). Measured cold, with empty Go module and build caches, on
# 2 shared cores: 5 minutes (150 s of CPU; 330 MB of modules, 430 MB of build cache).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(sed -n 's/^[[:space:]]*github.com\/versity\/versitygw \(v[^ ]*\).*/\1/p' "$here/go.mod" | head -1)
[ -n "$version" ] || { echo "s3server: no versitygw version in $here/go.mod" >&2; exit 1; }
dest="${DAVIT_CACHE:-$HOME/.cache/davit}/s3server/$version"
stamp="$version $(sha256sum "$here/go.sum" | cut -c1-16)"
if [ -x "$dest/versitygw" ] && [ "$(cat "$dest/.stamp" 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi
mkdir -p "$dest"
echo "s3server: building versitygw $version into $dest (cold: about 5 minutes)" >&2
(cd "$here" && CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -ldflags "-s -w" \
  -o "$dest/versitygw.tmp" github.com/versity/versitygw/cmd/versitygw)
mv "$dest/versitygw.tmp" "$dest/versitygw"
echo "$stamp" >"$dest/.stamp"
