#!/usr/bin/env bash
# Builds the metrics pipeline the autoscaling end-to-end test runs (tests/e2e/metrics_pipeline.py)
# from the Go module proxy into a cache outside the repository, keyed by version:
#
#   ${DAVIT_CACHE:-$HOME/.cache/davit}/metrics/prometheus/<version>/prometheus
#   ${DAVIT_CACHE:-$HOME/.cache/davit}/metrics/prometheus-adapter/<version>/adapter
#
# - Prometheus (Apache-2.0): only the service discovery the test uses (kubernetes_sd; static and
#   file discovery are always in) is compiled in, through Prometheus' own build tags
#   (remove_all_sd,enable_kubernetes_sd): the other discoveries would add their cloud SDKs.
#   Without the builtinassets tag it has no web UI; its HTTP API is all the adapter reads.
# - prometheus-adapter (Apache-2.0): serves custom.metrics.k8s.io from Prometheus queries.
#
# The wrapper modules beside this script (prometheus/, adapter/) pin every dependency (go.sum;
# built read-only, so a build never rewrites them). Idempotent: a binary whose stamp names the
# same version, go.sum and tags is kept (under a second). Measured cold, with empty Go module and
# build caches, on 2 shared cores: Prometheus 419 s, prometheus-adapter 353 s, 772 s in all, with
# other tests running alongside (load average about 4; 1.4 GB of modules, 1.9 GB of build cache);
# 712 s + 497 s beside the control plane's own cold build (load average about 9). They share no
# compiled package with the control plane: their Kubernetes libraries are other versions.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache="${DAVIT_CACHE:-$HOME/.cache/davit}/metrics"

version_of() { # wrapper-dir module
  sed -n "s#^[[:space:]]*$2 \(v[^ ]*\).*#\1#p" "$here/$1/go.mod" | head -1
}

build() { # wrapper-dir module package binary-name cache-name tags
  local dir=$1 module=$2 package=$3 name=$4 cache_name=$5 tags=$6
  local version dest stamp
  version=$(version_of "$dir" "$module")
  [ -n "$version" ] || { echo "metrics: no $module version in $here/$dir/go.mod" >&2; exit 1; }
  dest="$cache/$cache_name/$version"
  stamp="$version $(sha256sum "$here/$dir/go.sum" | cut -c1-16) tags=$tags"
  if [ -x "$dest/$name" ] && [ "$(cat "$dest/.stamp" 2>/dev/null)" = "$stamp" ]; then
    return 0
  fi
  mkdir -p "$dest"
  echo "metrics: building $cache_name $version into $dest" >&2
  local t0=$SECONDS
  (cd "$here/$dir" && CGO_ENABLED=0 GOFLAGS="-buildvcs=false -mod=readonly" go build -trimpath \
    -tags "$tags" -ldflags "-s -w" -o "$dest/$name.tmp" "$package") 2>&1 \
    | { grep -v '^go: downloading ' || true; } >&2
  mv "$dest/$name.tmp" "$dest/$name"
  echo "$stamp" >"$dest/.stamp"
  echo "metrics: $cache_name built in $((SECONDS - t0)) s" >&2
}

command -v go >/dev/null || { echo "metrics: Go is not installed; install Go >= 1.26.7 and put it on PATH" >&2; exit 1; }
build prometheus github.com/prometheus/prometheus github.com/prometheus/prometheus/cmd/prometheus \
  prometheus prometheus remove_all_sd,enable_kubernetes_sd
build adapter sigs.k8s.io/prometheus-adapter sigs.k8s.io/prometheus-adapter/cmd/adapter \
  adapter prometheus-adapter ""
