#!/usr/bin/env bash
# One device call for issue 18's goals. On an H200: W1 and W2 with bf16 in the same process
# (three interleaved rounds), then as GOALS_BUDGET_S allows the FP8 decode tiles and the
# one-row product tiles and forms at this card's bandwidth, the read ceiling, W1 again in the
# best decode tile if the sweep found one more than 2% faster over W1's steps, W2 in the
# one-row forms the sweep found more than 2% faster (best_gemv.py), the switches (two K steps
# a round at no tile and at both, against the default's 8 x 512 only) and the native
# block-scale checks (block_native). On another card:
# $H100_CMD if set, else block_native.
#   [H100_CMD='bench --sections w2-profile ...'] [GOALS_BUDGET_S=450] [GOALS_ROUNDS=3] \
#   [GOALS_W2_VARIANTS=fp8-both,fp8-both-lm-head-int8,fp8-both-lm-head-int8-cvt,bf16] \
#   bash hack/device/goals_call.sh  (under $OUT)
set -u
# env.sh is sourced from the repository root, where the device runs commands
# shellcheck source=/dev/null
. hack/device/env.sh
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $GPU"
bench() { python3 -m davit_tools.bench.fp8 "$@" >> "$OUT/log.txt" 2>&1; }
# Block-wise FP8 served with its own scales (--fp8-block-scales native): its GPU tests, then
# its products against the channel conversion and bf16 at Llama-8B's shapes (about 60 s).
block_native() {
  # the block kernels' and module's tests on this card (their `device` is CUDA here), then the
  # GPU-marked native tests of the loader and of runner V2's norm chain
  python3 -m pytest -q -p no:cacheprovider -rf tests/engine/kernels/test_fp8_block.py \
    tests/engine/quant/test_fp8_block_linear.py > "$OUT/block_tests.txt" 2>&1
  python3 -m pytest -q -p no:cacheprovider -rf -m gpu tests/engine/loader/test_fp8_checkpoints.py \
    tests/engine/runner/v2/test_fused_layers.py -k native >> "$OUT/block_tests.txt" 2>&1
  grep -E "passed|failed|FAILED|error" "$OUT/block_tests.txt" | tail -12
  python3 hack/device/block_native_probe.py 1,2,16,512,2048 > "$OUT/block_probe.jsonl" 2>&1
  cat "$OUT/block_probe.jsonl"
}
case "$GPU" in
*H200*)
  # in order of need, each step only while GOALS_BUDGET_S (default 450) leaves it time
  budget=${GOALS_BUDGET_S:-450}
  bench --sections w1,w2 --rounds "${GOALS_ROUNDS:-3}" --deadline-s 120 --w1-variants bf16,fp8-kv \
    --w2-variants "${GOALS_W2_VARIANTS:-fp8-both,fp8-both-lm-head-int8,fp8-both-lm-head-int8-cvt,bf16}"
  if [ $SECONDS -lt $((budget - 120)) ]; then
    bench --sections decode-tiles,gemm --gemm-rows 1 --gemm-configs "" --deadline-s 130 \
      --gemv-configs "$(printf '%s;' 8/512/4/0 4/1024/4/0 16/512/4/0 8/1024/4/0 \
        8/512/4/0/0/0/2 4/1024/4/0/0/0/2 8/512/4/0/3 4/1024/4/0/3 8/512/4/0/4 4/1024/4/0/4 \
        8/512/4/0/4/1 4/1024/4/0/4/1)"
  fi
  if [ $SECONDS -lt $((budget - 40)) ]; then
    python3 hack/device/read_ceiling.py > "$OUT/ceiling.txt" 2>&1
  fi
  best=$(python3 hack/device/best_tile.py "$OUT/fp8.jsonl")
  echo "best decode tile variant: ${best:-the engine tile}"
  if [ -n "$best" ] && [ $SECONDS -lt $((budget - 90)) ]; then
    bench --sections w1 --rounds 2 --deadline-s 80 --w1-variants "bf16,fp8-kv,$best"
  fi
  # the one-row product forms that beat the engine's in the sweep, in W2 (two K steps a
  # round at both tiles is timed below in any case)
  gemv=$(python3 hack/device/best_gemv.py "$OUT/fp8.jsonl" | sed 's/fp8-both-unroll2,\?//; s/,$//')
  echo "one-row forms to time in W2: ${gemv:-none}"
  if [ -n "$gemv" ] && [ $SECONDS -lt $((budget - 90)) ]; then
    bench --sections w2 --rounds 2 --deadline-s 80 --w2-variants "fp8-both,$gemv"
  fi
  if [ $SECONDS -lt $((budget - 90)) ]; then
    bench --sections w1,w2 --rounds 2 --deadline-s 80 \
      --w1-variants fp8-kv,fp8-kv-splits-fp8-1.9w,fp8-kv-splits-fp8-3w \
      --w2-variants fp8-both,fp8-both-unroll1,fp8-both-unroll2,fp8-both-rotary-one
  fi
  if [ $SECONDS -lt $((budget - 60)) ]; then block_native; fi
  ;;
*)
  if [ -n "${H100_CMD:-}" ]; then eval "$H100_CMD"; else block_native; fi
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
