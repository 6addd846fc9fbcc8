"""KV offload benchmark (issue 17) for one call to the GPU machine, through the offline engine.

Engines (one each, built in the order `--plan` gives, each running the sections it names):
- `baseline`: no offload tiers;
- `cpu`: a CPU tier of `--cpu-gib` (page-locked host memory);
- `disk`: a disk tier of `--disk-gib` under `--disk-dir` and no CPU tier (host bounce buffers
  only), so returning prefixes come from files.
All with the same `--kv-cache-memory-bytes` (the tiers' GPU staging buffers come out of it).

Sections:
- `check` (tiered engines): the same prompt served from the GPU prefix cache and, after its
  prefix was pushed out of the GPU, from the tier: the outputs must be identical (the loaded
  K/V are the stored bytes, so the suffix is computed from the same values);
- `noreuse`: unique random prompts, nothing shared: output tokens/s (the tiers' stores are
  pure overhead here);
- `multiturn`: conversations of a long unique context, each turn appending the previous answer
  and a new user message; conversations take turns round-robin with `--concurrency` in flight,
  so by the time one returns, the others' contexts have pushed its prefix out of the GPU cache
  (all contexts together exceed it). TTFT (submission to first token) p50/p99 of returning
  turns (2 and later) and of first turns, output tokens/s, prefill tokens computed.

Every result is a JSON line in `$OUT/offload.jsonl` with its configuration; a table is printed
last. On the GPU machine:

    . hack/device/env.sh && python3 -m davit_tools.bench.offload
CPU scale (development):
    python -m davit_tools.bench.offload --model random:qwen3-tiny --device cpu --dtype float32 \\
        --kv-cache-memory-bytes 1000000 --conversations 6 --context 200 --cpu-gib 0.01
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from davit_engine.config import EngineConfig
from davit_engine.core.block_manager import hash_block_tokens
from davit_engine.engine_core import EngineCore
from davit_engine.offload import disk as disk_io
from davit_engine.types import EngineRequest, SamplingParams

OUT = Path(os.environ.get("OUT", "/tmp/davit-offload"))
_IDS = [0]


def record(**fields: Any) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "offload.jsonl", "a") as f:
        f.write(json.dumps(fields) + "\n")
    print(json.dumps(fields), flush=True)


def versions() -> dict[str, str]:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda or ""}


def next_id() -> str:
    _IDS[0] += 1
    return f"b{_IDS[0]}"


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


@dataclass
class Conversation:
    tokens: list[int]  # everything so far: context, messages, answers
    turns_left: int
    turn: int = 0
    messages: list[list[int]] = field(default_factory=list)


def make_conversations(
    num: int, context: int, message: int, turns: int, vocab: int, seed: int
) -> list[Conversation]:
    rng = random.Random(seed)
    convs = []
    for _ in range(num):
        msgs = [random_tokens(rng, message, vocab) for _ in range(turns)]
        convs.append(Conversation(random_tokens(rng, context, vocab), turns, messages=msgs))
    return convs


@dataclass
class Timed:
    submitted: float
    turn: int
    conv: int
    prompt_len: int
    first: float | None = None
    tokens: list[int] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def computed_tokens(core: EngineCore) -> int:
    stats = core.stats()
    return stats.prompt_tokens_total


def run_multiturn(
    core: EngineCore, convs: list[Conversation], concurrency: int, answer: int
) -> dict[str, Any]:
    """Round-robin turns with `concurrency` conversations in flight; see the module."""
    params = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True)
    ready: deque[int] = deque(range(len(convs)))
    inflight: dict[str, Timed] = {}
    done: list[Timed] = []
    hits_before = core.stats().prefix_cache_hits
    loaded_before = sum(s.load_bytes for s in core.stats().kv_offload)
    bm = core.scheduler.block_manager
    queries_before = bm.prefix_cache_queries
    start = time.perf_counter()
    output_tokens = 0
    while ready or inflight:
        while ready and len(inflight) < concurrency:
            c = ready.popleft()
            conv = convs[c]
            prompt = conv.tokens + conv.messages[conv.turn]
            rid = next_id()
            inflight[rid] = Timed(time.perf_counter(), conv.turn + 1, c, len(prompt))
            conv.tokens = prompt
            core.add_request(EngineRequest(rid, prompt, params))
        deltas = core.step()
        now = time.perf_counter()
        for delta in deltas:
            timed = inflight.get(delta.request_id)
            if timed is None:
                continue
            if delta.new_token_ids and timed.first is None:
                timed.first = now
            timed.tokens += delta.new_token_ids
            output_tokens += len(delta.new_token_ids)
            if delta.finished:
                del inflight[delta.request_id]
                done.append(timed)
                conv = convs[timed.conv]
                conv.tokens = conv.tokens + timed.tokens
                conv.turn += 1
                conv.turns_left -= 1
                if conv.turns_left:
                    ready.append(timed.conv)
    wall = time.perf_counter() - start
    back = [(t.first or now) - t.submitted for t in done if t.turn > 1]
    first = [(t.first or now) - t.submitted for t in done if t.turn == 1]
    stats = core.stats()
    return {
        "requests": len(done),
        "returning": len(back),
        "ttft_back_p50_ms": percentile(back, 50) * 1e3,
        "ttft_back_p99_ms": percentile(back, 99) * 1e3,
        "ttft_back_mean_ms": statistics.fmean(back) * 1e3 if back else float("nan"),
        "ttft_first_p50_ms": percentile(first, 50) * 1e3,
        "output_tok_s": output_tokens / wall,
        "wall_s": wall,
        "gpu_prefix_hit_tokens": stats.prefix_cache_hits - hits_before,
        "prefix_lookup_tokens": bm.prefix_cache_queries - queries_before,
        "loaded_bytes": sum(s.load_bytes for s in stats.kv_offload) - loaded_before,
        "answers": [t.tokens for t in sorted(done, key=lambda t: (t.conv, t.turn))],
    }


def run_batch(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = []
    for prompt in prompts:
        ids.append(next_id())
        core.add_request(EngineRequest(ids[-1], prompt, params))
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    start = time.perf_counter()
    while core.has_unfinished_requests():
        for delta in core.step():
            if delta.request_id in outputs:
                outputs[delta.request_id] += delta.new_token_ids
    wall = time.perf_counter() - start
    total = sum(len(o) for o in outputs.values())
    return {"output_tok_s": total / wall, "wall_s": wall, "outputs": [outputs[i] for i in ids]}


def check_tier(core: EngineCore, vocab: int, context: int, fill_blocks: int) -> dict[str, Any]:
    """Same prompt from the GPU prefix cache, then (after fillers) from the tier."""
    rng = random.Random(99)
    prefix = random_tokens(rng, context, vocab)
    run_batch(core, [prefix + [5]], 4)
    gpu = run_batch(core, [prefix + [7, 8]], 16)["outputs"][0]  # prefix from the GPU cache
    hashes = prefix_hashes(core, prefix)
    snapshot = prefix_images(core, hashes)
    bs = core.config.block_size
    loaded_before = sum(s.load_bytes for s in core.stats().kv_offload)
    filler_len = min(core.scheduler.max_model_len - 8, fill_blocks * bs)
    pushed = 0
    while pushed < core.scheduler.block_manager.num_blocks + context // bs:
        run_batch(core, [random_tokens(rng, filler_len, vocab)], 1)
        pushed += filler_len // bs
    tier = run_batch(core, [prefix + [7, 8]], 16)["outputs"][0]
    loaded = sum(s.load_bytes for s in core.stats().kv_offload) - loaded_before
    result: dict[str, Any] = {
        "identical": gpu == tier,
        "loaded_bytes": loaded,
        "gpu": gpu,
        "tier": tier,
    }
    if snapshot is not None:
        # Where a difference comes from: the prefix's block images as the GPU cache held them
        # before the fillers, against the blocks loaded back and (disk tier) the files.
        again = prefix_images(core, hashes)
        if again is not None:
            result["loaded_blocks_differing"] = differing_rows(snapshot, again)
        files = file_images(core, hashes)
        if files is not None:
            result["files_differing"] = differing_rows(snapshot, files)
    return result


def prefix_hashes(core: EngineCore, tokens: list[int]) -> list[bytes]:
    bs = core.config.block_size
    hashes: list[bytes] = []
    for i in range(len(tokens) // bs):
        hashes.append(
            hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs])
        )
    return hashes


def prefix_images(core: EngineCore, hashes: list[bytes]) -> torch.Tensor | None:
    """The GPU cache's images of the blocks `hashes` ([n, block bytes] on the host), None when
    one of them is not in the GPU prefix cache or the engine has no tiers."""
    tiers = core.tiers
    if tiers is None:
        return None
    ids = [core.scheduler.block_manager.cached_block_id(h) for h in hashes]
    if any(i is None for i in ids):
        return None
    image = tiers.mover.image
    outs = [
        torch.empty(len(ids), n, dtype=torch.uint8, device=image.device) for n in image.part_bytes
    ]
    image.gather(torch.tensor(ids, dtype=torch.int64, device=image.device), outs)
    return torch.cat(outs, dim=1).cpu()


def file_images(core: EngineCore, hashes: list[bytes]) -> torch.Tensor | None:
    """The disk tier's files of the blocks `hashes`, read and checked as a load reads them."""
    tiers = core.tiers
    if tiers is None or tiers.disk is None:
        return None
    disk = tiers.disk
    out = torch.zeros(len(hashes), tiers.block_bytes, dtype=torch.uint8)
    for i, h in enumerate(hashes):
        status = disk_io.read_block(disk.path(h), disk.digest, h, out[i].numpy())
        if status is not disk_io.ReadStatus.OK:
            out[i].fill_(0)
    return out


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    return [i for i in range(a.shape[0]) if not torch.equal(a[i], b[i])]


def make_core(args: argparse.Namespace, tier: str) -> EngineCore:
    flags: dict[str, Any] = {}
    tier, *options = tier.split("+")  # disk+sync: async scheduling off; +eager: no CUDA graphs
    if "sync" in options:
        flags["async_scheduling"] = False
    if "eager" in options:
        flags["enforce_eager"] = True
    if tier == "cpu":
        flags["kv_offloading_size"] = args.cpu_gib
    if tier == "disk":
        flags["kv_offload_disk_path"] = args.disk_dir
        flags["kv_offload_disk_bytes"] = int(args.disk_gib * 2**30)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes or None,
        num_gpu_blocks=args.num_gpu_blocks,
        **flags,
    )
    return EngineCore(config)


def describe(core: EngineCore, args: argparse.Namespace, tier: str) -> dict[str, Any]:
    info = core.model_info
    return {
        "engine": tier,
        "model": args.model,
        "dtype": info.dtype,
        "runner": info.runner,
        "async": info.async_scheduling,
        "cuda_graphs": bool(getattr(core.runner, "use_graphs", False)),
        "gpu_blocks": info.num_blocks,
        "block_size": info.block_size,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "offload": info.kv_offload,
        **versions(),
    }


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        import sys

        argv = sys.argv[1:]
    if argv[:1] == ["summarize"]:  # the table of a results file (after a run that timed out)
        saved = [json.loads(line) for line in Path(argv[1]).read_text().splitlines()]
        summarize([r for r in saved if r["section"] in ("noreuse", "multiturn")])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--plan",
        default="baseline:noreuse,multiturn;cpu:check,noreuse,multiturn;disk:check,multiturn",
        help="ENGINE:SECTION,...;... (engines baseline, cpu, disk, each optionally with +sync "
        "(no asynchronous scheduling) and +eager (no CUDA graphs); sections check, noreuse, "
        "multiturn), run in this order",
    )
    p.add_argument("--kv-cache-memory-bytes", type=int, default=3 * 2**30)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--cpu-gib", type=float, default=12.0)
    p.add_argument("--disk-gib", type=float, default=12.0)
    p.add_argument("--disk-dir", default=None)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--context", type=int, default=1536)
    p.add_argument("--message", type=int, default=64)
    p.add_argument("--answer", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--noreuse-requests", type=int, default=64)
    p.add_argument("--noreuse-prompt", type=int, default=1024)
    p.add_argument("--noreuse-output", type=int, default=128)
    args = p.parse_args(argv)
    if args.disk_dir is None:
        args.disk_dir = tempfile.mkdtemp(prefix="davit-kv-")
    vocab = 1000
    baseline_answers: list[list[int]] | None = None
    rows: list[dict[str, Any]] = []
    for step in args.plan.split(";"):
        tier, _, wanted = step.partition(":")
        sections = wanted.split(",")
        try:
            started = time.perf_counter()
            core = make_core(args, tier)
            vocab = min(core.model_info.vocab_size, 32000)
            base = describe(core, args, tier)
            record(section="engine", startup_s=time.perf_counter() - started, **base)
            run_batch(core, make_prompts(4, 256, vocab, 1), 8)  # warm-up: compile, caches
            if "check" in sections and not tier.startswith("baseline"):
                result = check_tier(core, vocab, min(1024, args.context), 64)
                record(section="check", **base, **result)
            if "noreuse" in sections:
                prompts = make_prompts(args.noreuse_requests, args.noreuse_prompt, vocab, 2)
                result = run_batch(core, prompts, args.noreuse_output)
                result.pop("outputs")
                row = dict(section="noreuse", **base, **result, requests=len(prompts))
                row.update(prompt=args.noreuse_prompt, output=args.noreuse_output)
                record(**row)
                rows.append(row)
            if "multiturn" in sections:
                convs = make_conversations(
                    args.conversations, args.context, args.message, args.turns, vocab, 3
                )
                result = run_multiturn(core, convs, args.concurrency, args.answer)
                answers = result.pop("answers")
                if baseline_answers is None:
                    baseline_answers = answers
                same = sum(a == b for a, b in zip(answers, baseline_answers, strict=False))
                row = dict(section="multiturn", **base, **result, same_answers_as_first=same)
                row.update(
                    conversations=args.conversations,
                    context=args.context,
                    message=args.message,
                    answer=args.answer,
                    turns=args.turns,
                    concurrency=args.concurrency,
                    offload_stats=[vars(s) for s in core.stats().kv_offload],
                )
                record(**row)
                rows.append(row)
            core.shutdown()
            del core
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # one engine failing must not lose the others' results
            record(section="error", engine=tier, traceback=traceback.format_exc()[-3000:])
    summarize(rows)
    return 0


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_tokens(rng, length, vocab) for _ in range(num)]


def summarize(rows: list[dict[str, Any]]) -> None:
    print(
        "\nengine     section    out tok/s  TTFT back p50 / p99 ms  first-turn p50 ms  loaded GiB"
    )
    for r in rows:
        if r["section"] == "multiturn":
            print(
                f"{r['engine']:<10} multiturn  {r['output_tok_s']:9.0f}  "
                f"{r['ttft_back_p50_ms']:10.1f} / {r['ttft_back_p99_ms']:7.1f}  "
                f"{r['ttft_first_p50_ms']:17.1f}  {r['loaded_bytes'] / 2**30:10.2f}"
            )
        else:
            print(f"{r['engine']:<10} noreuse    {r['output_tok_s']:9.0f}")


if __name__ == "__main__":
    raise SystemExit(main())
