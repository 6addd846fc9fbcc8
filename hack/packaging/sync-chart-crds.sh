#!/usr/bin/env bash
# Assembles the Helm chart's crds/ folder (which helm installs before the chart's templates) from
#   crds/                  the generated InferenceService CRD (python -m davit_operator.api.crdgen)
#   hack/packaging/crds/   CRDs of the frameworks the operator runs on (kopf's peering resource)
# The chart copy is never edited by hand.
#   sync-chart-crds.sh           make charts/davit/crds/ equal to crds/
#   sync-chart-crds.sh --check   exit 1 (naming the files) when they differ; change nothing
set -euo pipefail
cd "$(dirname "$0")/../.."
generated=crds
extra=hack/packaging/crds
dst=charts/davit/crds

mode=sync
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

shopt -s nullglob
generated_files=("$generated"/*.yaml)
if [ ${#generated_files[@]} -eq 0 ]; then
  echo "sync-chart-crds: $generated/ has no CRDs; generate them with python -m davit_operator.api.crdgen" >&2
  exit 1
fi
sources=("${generated_files[@]}" "$extra"/*.yaml)
declare -A source_of=()
for f in "${sources[@]}"; do
  name=$(basename "$f")
  if [ -n "${source_of[$name]:-}" ]; then
    echo "sync-chart-crds: $name is in both ${source_of[$name]} and $f; keep one" >&2
    exit 1
  fi
  source_of[$name]=$f
done

stale=()
for f in "$dst"/*; do
  [ -n "${source_of[$(basename "$f")]:-}" ] || stale+=("$f")
done
differ=()
for f in "${sources[@]}"; do
  cmp -s "$f" "$dst/$(basename "$f")" || differ+=("$f")
done

if [ "$mode" = check ]; then
  if [ ${#stale[@]} -ne 0 ] || [ ${#differ[@]} -ne 0 ]; then
    for f in "${differ[@]}"; do echo "sync-chart-crds: $dst/$(basename "$f") differs from $f" >&2; done
    for f in "${stale[@]}"; do echo "sync-chart-crds: $f has no source in $generated/ or $extra/" >&2; done
    echo "sync-chart-crds: run hack/packaging/sync-chart-crds.sh" >&2
    exit 1
  fi
  exit 0
fi

mkdir -p "$dst"
for f in "${stale[@]}"; do rm -f "$f"; done
for f in "${differ[@]}"; do cp "$f" "$dst/"; done
echo "sync-chart-crds: $dst/ matches $generated/ and $extra/ (${#sources[@]} file(s))"
