#!/usr/bin/env bash
# Builds the local control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, kwok) from the Go module proxy into a cache outside the repository, keyed by the
# Kubernetes version:
#
#   ${DAVIT_CACHE:-$HOME/.cache/davit}/k8s/<kubernetes version>/bin/        binaries
#   ${DAVIT_CACHE:-$HOME/.cache/davit}/k8s/<kubernetes version>/kwok-stages/ kwok stage configs
#
# Idempotent: every group of binaries carries a stamp naming the exact versions it was built from,
# and a group whose binaries and stamp are present is skipped, so a warm run takes about a second.
# Versions are pinned in tools/davit_tools/devcluster/versions.json; the Go wrapper modules
# under hack/controlplane/{k8s,etcd,kwok}/ pin every dependency (update-modules.sh regenerates them).
#
# Environment: DAVIT_CACHE (cache root), DAVIT_CONTROLPLANE_FORCE=1 (rebuild even when stamped).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
versions="$here/../../tools/davit_tools/devcluster/versions.json"

log() { echo "controlplane: $*" >&2; }
die() { log "error: $*"; exit 1; }

pin() {
  # Plain sed instead of a JSON parser: this runs before anything else is guaranteed installed.
  local v
  v=$(sed -n "s/^[[:space:]]*\"$1\"[[:space:]]*:[[:space:]]*\"\([^\"]*\)\".*/\1/p" "$versions")
  [ -n "$v" ] || die "no \"$1\" pin in $versions"
  echo "$v"
}
k8s=$(pin kubernetes)
etcd=$(pin etcd)
kwok=$(pin kwok)

cache_root=${DAVIT_CACHE:-$HOME/.cache/davit}
dest="$cache_root/k8s/$k8s"
bin="$dest/bin"
stages="$dest/kwok-stages"

k8s_bins=(kube-apiserver kube-controller-manager kube-scheduler kubectl)

# A group is up to date when each binary is executable and the stamp names the same inputs.
# The stamp includes the go.sum hash so a dependency bump in a wrapper module rebuilds too.
stamp_of() { # group version
  echo "$2 $(sha256sum "$here/$1/go.sum" | cut -c1-16)"
}
is_fresh() { # group version binaries...
  local group=$1 version=$2
  shift 2
  [ "${DAVIT_CONTROLPLANE_FORCE:-0}" = 1 ] && return 1
  [ "$(cat "$bin/.$group.stamp" 2>/dev/null)" = "$(stamp_of "$group" "$version")" ] || return 1
  local b
  for b in "$@"; do [ -x "$bin/$b" ] || return 1; done
  [ "$group" != kwok ] || [ -s "$stages/pod-ready.yaml" ]
}

find_needed() {
  need=()
  is_fresh k8s "$k8s" "${k8s_bins[@]}" || need+=(k8s)
  is_fresh etcd "$etcd" etcd || need+=(etcd)
  is_fresh kwok "$kwok" kwok || need+=(kwok)
  if [ "${#need[@]}" -eq 0 ]; then
    log "up to date in $bin (kubernetes $k8s, etcd $etcd, kwok $kwok)"
    exit 0
  fi
}
find_needed
mkdir -p "$dest"
# Two checkouts running `make install` at once share this cache: the second waits for the first
# and then finds everything built.
if command -v flock >/dev/null; then
  exec 9>"$dest/.build.lock"
  if ! flock -n 9; then
    log "another build into $dest is running; waiting for it"
    flock 9
    find_needed
  fi
fi

command -v go >/dev/null || die "Go is not installed; install Go >= 1.26 (for example to /usr/local/go) and put it on PATH"
go_minor=$(go env GOVERSION | sed -n 's/^go1\.\([0-9]*\).*/\1/p')
if [ "${go_minor:-0}" -lt 26 ]; then
  # The etcd and kwok wrapper modules declare go 1.26; with GOTOOLCHAIN=auto (the default) the
  # go command fetches that toolchain as a module, with GOTOOLCHAIN=local it stops with an error.
  log "Go $(go env GOVERSION) is older than the 1.26 these modules need; the go command will fetch go1.26 (GOTOOLCHAIN=$(go env GOTOOLCHAIN))"
fi

# A cold module cache makes the go command print one "downloading" line per module (hundreds);
# keep the build log to what matters.
without_download_lines() { { grep -v '^go: downloading ' || true; } >&2; }

export CGO_ENABLED=0
# -mod=readonly: build exactly what the committed go.mod/go.sum say, never update them silently.
export GOFLAGS="-buildvcs=false -mod=readonly"
mkdir -p "$bin" "$stages"
work=$(mktemp -d "$dest/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT
trap 'log "error: the build failed (see above); it needs the Go module proxy (GOPROXY=$(go env GOPROXY)) and a writable $dest"' ERR

started=$(date +%s)
for group in "${need[@]}"; do
  t0=$(date +%s)
  case $group in
    k8s)
      major=${k8s#v}; major=${major%%.*}
      minor=${k8s#v*.}; minor=${minor%%.*}
      # The module's publication time is a deterministic build date.
      build_date=$(cd "$here/k8s" && go list -m -f '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)
      ldflags="-s -w"
      # Unstamped binaries report v0.0.0, which breaks helm's and kwok's version checks.
      for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X $pkg.gitVersion=$k8s -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
        ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
      done
      log "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl $k8s (one go build; 5-10 minutes on 2 cores when the Go build cache is cold)"
      pkgs=()
      for b in "${k8s_bins[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
      # One invocation compiles the shared packages once for all four binaries.
      (cd "$here/k8s" && go build -trimpath -ldflags "$ldflags" -o "$work/" "${pkgs[@]}") 2>&1 | without_download_lines
      for b in "${k8s_bins[@]}"; do mv -f "$work/$b" "$bin/$b"; done
      ;;
    etcd)
      log "building etcd $etcd"
      (cd "$here/etcd" && go build -trimpath -ldflags "-s -w" -o "$work/etcd" go.etcd.io/etcd/server/v3) 2>&1 | without_download_lines
      mv -f "$work/etcd" "$bin/etcd"
      ;;
    kwok)
      log "building kwok $kwok"
      (cd "$here/kwok" && go build -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${kwok#v}" \
        -o "$work/kwok" sigs.k8s.io/kwok/cmd/kwok) 2>&1 | without_download_lines
      mv -f "$work/kwok" "$bin/kwok"
      # Standalone kwok needs stage definitions; they ship in kwok's module, which is in the
      # module cache after the build above.
      mod_dir=$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
      cp -f "$mod_dir/kustomize/stage/node/fast/node-initialize.yaml" \
        "$mod_dir/kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
        "$mod_dir/kustomize/stage/pod/fast/pod-ready.yaml" \
        "$mod_dir/kustomize/stage/pod/fast/pod-complete.yaml" \
        "$mod_dir/kustomize/stage/pod/fast/pod-delete.yaml" \
        "$stages/"
      chmod 0644 "$stages"/*.yaml
      ;;
  esac
  stamp_of "$group" "$(case $group in k8s) echo "$k8s" ;; etcd) echo "$etcd" ;; kwok) echo "$kwok" ;; esac)" >"$bin/.$group.stamp"
  log "$group built in $(($(date +%s) - t0)) s"
done
log "done in $(($(date +%s) - started)) s; binaries in $bin"
