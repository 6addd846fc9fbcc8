#!/usr/bin/env bash
# One device call for issue 18's goals. On an H200: W1 and W2 with bf16 in the same process
# (three interleaved rounds), the FP8 decode tiles and the one-row product tiles at this
# card's bandwidth, the read ceiling, and W1 again in the best decode tile if the sweep
# found one more than 2% faster over W1's steps. On another card: only $H100_CMD, if set.
#   [H100_CMD='bench --sections w2-profile ...'] bash hack/device/goals_call.sh  (writes under $OUT)
set -u
. hack/device/env.sh
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $GPU"
bench() { python3 -m davit_tools.bench.fp8 "$@" >> "$OUT/log.txt" 2>&1; }
case "$GPU" in
*H200*)
  bench --sections w1,w2 --rounds 3 --deadline-s 330 \
    --w1-variants bf16,fp8-kv,fp8-kv-rotary-one,fp8-kv-splits-fp8-3w \
    --w2-variants fp8-both,fp8-both-lm-head,bf16,fp8-both-rotary-one,fp8-both-norm-kernels+fp8-both-stream4
  bench --sections decode-tiles,gemm --gemm-rows 1 --gemm-configs "" --deadline-s 150 \
    --gemv-configs "8/512/4/0;4/1024/4/0;16/512/4/0;8/1024/4/0;16/1024/4/0;16/1024/8/0;8/512/4/0/3;8/512/4/0/4;4/1024/4/0/4"
  python3 hack/device/read_ceiling.py > "$OUT/ceiling.txt" 2>&1
  best=$(python3 hack/device/best_tile.py "$OUT/fp8.jsonl")
  echo "best decode tile variant: ${best:-the engine tile}"
  if [ -n "$best" ]; then
    bench --sections w1 --rounds 2 --deadline-s 120 --w1-variants "bf16,fp8-kv,$best"
  fi
  ;;
*)
  if [ -n "${H100_CMD:-}" ]; then eval "$H100_CMD"; fi
  ;;
esac
[ -f "$OUT/log.txt" ] || exit 0
grep -v '^{' "$OUT/log.txt" | grep -i "error\|Traceback" | head -5
python3 - "$OUT/fp8.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    r.pop("kernels", None)
    print({k: v for k, v in r.items() if k not in ("gpu", "torch", "triton", "outputs")})
PY
