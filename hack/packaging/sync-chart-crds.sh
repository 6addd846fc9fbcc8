#!/usr/bin/env bash
# Copies the generated CRDs (crds/, written by `python -m davit_operator.api.crdgen`) into the Helm
# chart's crds/ folder, which helm installs before the chart's templates. The chart copy is never
# edited by hand.
#   sync-chart-crds.sh           make charts/davit/crds/ equal to crds/
#   sync-chart-crds.sh --check   exit 1 (naming the files) when they differ; change nothing
set -euo pipefail
cd "$(dirname "$0")/../.."
src=crds
dst=charts/davit/crds

mode=sync
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

shopt -s nullglob
sources=("$src"/*.yaml)
if [ ${#sources[@]} -eq 0 ]; then
  echo "sync-chart-crds: $src/ has no CRDs; generate them with python -m davit_operator.api.crdgen" >&2
  exit 1
fi

stale=()
for f in "$dst"/*; do
  [ -e "$src/$(basename "$f")" ] || stale+=("$f")
done
differ=()
for f in "${sources[@]}"; do
  cmp -s "$f" "$dst/$(basename "$f")" || differ+=("$f")
done

if [ "$mode" = check ]; then
  if [ ${#stale[@]} -ne 0 ] || [ ${#differ[@]} -ne 0 ]; then
    for f in "${differ[@]}"; do echo "sync-chart-crds: $dst/$(basename "$f") differs from $f" >&2; done
    for f in "${stale[@]}"; do echo "sync-chart-crds: $f has no source in $src/" >&2; done
    echo "sync-chart-crds: run hack/packaging/sync-chart-crds.sh" >&2
    exit 1
  fi
  exit 0
fi

mkdir -p "$dst"
for f in "${stale[@]}"; do rm -f "$f"; done
for f in "${differ[@]}"; do cp "$f" "$dst/"; done
echo "sync-chart-crds: $dst/ matches $src/ (${#sources[@]} file(s))"
