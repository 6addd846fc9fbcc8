"""Speculative-decoding benchmarks (issue 16) for one call to the GPU machine each.

Sections (`--sections`, in this order):
- `synthetic`: a Llama-3.1-8B shape with a Llama-3.2-1B-shape draft model (random weights, bf16,
  K=4), greedy, 128 random prompt tokens, 64 output tokens, batch 1 and 64: no speculation,
  strict verification (real acceptance of random weights: about zero), and upstream's
  `synthetic` acceptance (lossy, benchmarking only) at mean lengths 1, 2, 3 and K+1 tokens per
  step, which bracket what a trained draft gives;
- `budget`: the same engine at synthetic length 3, batch 64 and 256 (256 prompt tokens, 64
  output tokens, --max-num-batched-tokens 2048): draft work outside the target's budget (this
  engine) against the upstream-style reservation of max_num_seqs x K budget tokens for drafts;
- `editing`: SmolLM2-135M-Instruct real weights (fp32), prompts that ask to return a 500-1,000
  token passage with small changes (`prepare` builds them, chat template applied, here where
  the tokenizer loads), greedy, up to 256 output tokens, batch 1 and 32: no speculation,
  n-gram with strict verification, and n-gram with FLy; decode tokens/s, mean acceptance
  length, and the share of output tokens that differ from no speculation. Every (policy,
  batch) pair runs its whole workload once untimed before the timed run: eager mixed steps of
  new shapes compile Triton kernels on first use, and a short warm-up leaves some of those
  compilations inside the timed run (batch 32 then varied 2-4x between otherwise equal runs).

The lossy policies are benchmarked on the strict engine by swapping its verification policy
between runs (`runner.spec.policy`); every result line names the policy it ran with. Each
result is one JSON line in `$OUT/spec_decode.jsonl`; a table is printed last.

    python3 -m davit_tools.bench.spec_decode prepare --out .device/editing_prompts.json
    . hack/device/env.sh && python3 -m davit_tools.bench.spec_decode run --sections synthetic,budget
    . hack/device/env.sh && python3 -m davit_tools.bench.spec_decode run --sections editing \\
        --smollm2-gguf .device/SmolLM2-135M-Instruct.Q4_1.gguf --prompts .device/editing_prompts.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from davit_engine.config import EngineConfig
from davit_engine.engine_core import EngineCore
from davit_engine.kernels.rejection import VerifyPolicy
from davit_engine.spec_decode.config import speculative_config_from_json
from davit_engine.types import EngineRequest, SamplingParams

OUT = Path(os.environ.get("OUT", "/tmp/davit-spec-decode"))
RESULTS: list[dict[str, Any]] = []
EDIT_INSTRUCTION = (
    "Return the following passage exactly as it is, except: write the word 'engine' as "
    "'ENGINE'. Do not add anything.\n\n"
)


def record(**fields: Any) -> None:
    RESULTS.append(fields)
    with open(OUT / "spec_decode.jsonl", "a") as f:
        f.write(json.dumps(fields) + "\n")
    print(json.dumps({k: v for k, v in fields.items() if k != "outputs"}), flush=True)


def versions() -> dict[str, str]:
    import triton

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__}


def make_core(model: str, spec: dict[str, Any] | None, **limits: Any) -> EngineCore:
    config = EngineConfig(
        model=model,
        enable_prefix_caching=False,
        speculative_config=speculative_config_from_json(spec) if spec else None,
        **limits,
    )
    return EngineCore(config)


@dataclass
class Outcome:
    outputs: list[list[int]]
    wall_s: float
    output_tokens: int
    decode_tok_s: float  # sum over requests of (outputs - 1) / (last - first token time)
    mean_tpot_ms: float
    drafts: int
    draft_tokens: int
    accepted: int

    @property
    def acceptance_length(self) -> float:
        """Tokens per verification step with drafts (accepted + the target's own)."""
        return 1 + self.accepted / self.drafts if self.drafts else 1.0


_COUNTER = [0]


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> Outcome:
    stats = core.scheduler.spec_stats
    before = (
        (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        if stats
        else (0, 0, 0)
    )
    ids = []
    for prompt in prompts:
        _COUNTER[0] += 1
        ids.append(f"q{_COUNTER[0]}")
        core.add_request(EngineRequest(ids[-1], prompt, params))
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    while core.has_unfinished_requests():
        deltas = core.step()
        now = time.perf_counter()
        for delta in deltas:
            if delta.new_token_ids:
                first.setdefault(delta.request_id, now)
                last[delta.request_id] = now
                outputs[delta.request_id].extend(delta.new_token_ids)
    wall = time.perf_counter() - start
    rates, tpots = [], []
    for i in ids:
        n = len(outputs[i])
        span = last.get(i, 0.0) - first.get(i, 0.0)
        if n > 1 and span > 0:
            rates.append((n - 1) / span)
            tpots.append(span / (n - 1) * 1e3)
    after = (
        (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        if stats
        else (0, 0, 0)
    )
    return Outcome(
        outputs=[outputs[i] for i in ids],
        wall_s=wall,
        output_tokens=sum(len(o) for o in outputs.values()),
        decode_tok_s=sum(rates),
        mean_tpot_ms=sum(tpots) / len(tpots) if tpots else 0.0,
        drafts=after[0] - before[0],
        draft_tokens=after[1] - before[1],
        accepted=after[2] - before[2],
    )


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(num)]


def set_policy(core: EngineCore, policy: VerifyPolicy) -> None:
    spec = getattr(core.runner, "spec", None)
    assert spec is not None, "the engine runs without speculative decoding"
    spec.policy = policy


def describe(core: EngineCore) -> dict[str, Any]:
    config = core.config
    spec = getattr(core.runner, "spec", None)
    return {
        "model": config.model,
        "draft": config.speculative_config.model if config.speculative_config else None,
        "method": config.speculative_config.method if config.speculative_config else "none",
        "K": config.speculative_config.num_speculative_tokens if config.speculative_config else 0,
        "verification": spec.policy.method if spec is not None else "none",
        "lossy": spec is not None and spec.policy.method != "strict",
        "dtype": core.model_info.dtype,
        "runner": core.model_info.runner,
        "cuda_graphs": bool(getattr(core.runner, "use_graphs", False)),
        "async_scheduling": core.model_info.async_scheduling,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "draft_budget": core.scheduler.draft_budget,
    }


def emit(
    section: str, label: str, core: EngineCore, batch: int, out: Outcome, **extra: Any
) -> None:
    record(
        section=section,
        label=label,
        batch=batch,
        **describe(core),
        wall_s=round(out.wall_s, 4),
        output_tokens=out.output_tokens,
        output_tok_s=round(out.output_tokens / out.wall_s, 1),
        decode_tok_s=round(out.decode_tok_s, 1),
        mean_tpot_ms=round(out.mean_tpot_ms, 3),
        acceptance_length=round(out.acceptance_length, 3),
        drafts=out.drafts,
        draft_tokens=out.draft_tokens,
        accepted=out.accepted,
        **versions(),
        **extra,
    )


def free(*cores: EngineCore) -> None:
    for core in cores:
        core.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- sections ---------------------------------------------------------------------------------

TARGET_8B, DRAFT_1B, K_8B = "random:llama-3.1-8b", "random:llama-3.2-1b", 4
LIMITS_8B = {
    "dtype": "bfloat16",
    "max_num_seqs": 256,
    "max_num_batched_tokens": 2048,
    "max_model_len": 1024,
    "num_gpu_blocks": 12288,
}


def section_synthetic(_: argparse.Namespace) -> None:
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = make_core(TARGET_8B, None, **LIMITS_8B)
    vocab = plain.model_info.vocab_size
    run(plain, random_prompts(64, 128, vocab, 1), warm)
    for batch in (1, 64):
        out = run(plain, random_prompts(batch, 128, vocab, 2), greedy)
        emit("synthetic", "no speculation", plain, batch, out)
    free(plain)
    spec = {"method": "draft_model", "model": DRAFT_1B, "num_speculative_tokens": K_8B}
    core = make_core(TARGET_8B, spec, **LIMITS_8B)
    run(core, random_prompts(64, 128, vocab, 1), warm)
    for batch in (1, 64):
        out = run(core, random_prompts(batch, 128, vocab, 2), greedy)
        emit("synthetic", "draft model, strict", core, batch, out)
    for length in (1, 2, 3, K_8B + 1):
        set_policy(core, VerifyPolicy("synthetic", synthetic_length=float(length)))
        for batch in (1, 64):
            out = run(core, random_prompts(batch, 128, vocab, 2), greedy)
            emit(
                "synthetic",
                f"draft model, synthetic length {length}",
                core,
                batch,
                out,
                synthetic_length=length,
            )
    _BUDGET_CORE[0] = core


_BUDGET_CORE: list[EngineCore | None] = [None]


def section_budget(_: argparse.Namespace) -> None:
    core = _BUDGET_CORE[0]
    if core is None:
        spec = {"method": "draft_model", "model": DRAFT_1B, "num_speculative_tokens": K_8B}
        core = make_core(TARGET_8B, spec, **LIMITS_8B)
    vocab = core.model_info.vocab_size
    set_policy(core, VerifyPolicy("synthetic", synthetic_length=3.0))
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for batch in (64, 256):
        prompts = random_prompts(batch, 256, vocab, 3)
        for mode in ("separate", "reserved"):
            core.scheduler.draft_budget = mode
            # The first mixed prefill + verification steps of a new prompt length and batch pay
            # one-time costs (graph sizes, allocator growth): run them before timing each mode,
            # so neither mode pays them for the other (the first recorded batch-64 pair did).
            run(core, random_prompts(batch, 256, vocab, 4), warm)
            out = run(core, prompts, params)
            emit(
                "budget",
                f"draft budget {mode}, synthetic length 3",
                core,
                batch,
                out,
                synthetic_length=3,
                input_len=256,
            )
    core.scheduler.draft_budget = "separate"
    free(core)
    _BUDGET_CORE[0] = None


def section_editing(args: argparse.Namespace) -> None:
    prompts: list[list[int]] = json.loads(Path(args.prompts).read_text())
    gguf = str(args.smollm2_gguf)
    limits = {
        "dtype": "float32",
        "max_num_seqs": 32,
        "max_num_batched_tokens": 4096,
        "max_model_len": 2048,
        "num_gpu_blocks": 4096,
    }
    params = SamplingParams(max_tokens=256, temperature=0.0)
    batches = {1: prompts[:1], 32: prompts[:32]}
    plain = make_core(gguf, None, **limits)
    reference: dict[int, list[list[int]]] = {}
    for batch, group in batches.items():
        run(plain, group, params)  # warm-up: the same workload, untimed
        out = run(plain, group, params)
        reference[batch] = out.outputs
        emit(
            "editing",
            "no speculation",
            plain,
            batch,
            out,
            prompt_tokens=[len(p) for p in group][:4],
            outputs=out.outputs,
        )
    free(plain)
    k = args.editing_k
    spec = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    }
    core = make_core(gguf, spec, **limits)
    fly = VerifyPolicy(
        "fly", fly_window=min(6, k - 1), fly_entropy_threshold=0.3, fly_entropy_top_k=3
    )
    for policy in (VerifyPolicy(), fly):
        set_policy(core, policy)
        for batch, group in batches.items():
            run(core, group, params)  # warm-up: the same workload, untimed
            out = run(core, group, params)
            same, total = _agreement(reference[batch], out.outputs)
            emit(
                "editing",
                f"n-gram, {policy.method}",
                core,
                batch,
                out,
                identical_tokens=same,
                reference_tokens=total,
                differing_share=round(1 - same / max(total, 1), 4),
                identical_requests=sum(
                    a == b for a, b in zip(reference[batch], out.outputs, strict=True)
                ),
                outputs=out.outputs,
            )
    free(core)


def _agreement(reference: list[list[int]], outputs: list[list[int]]) -> tuple[int, int]:
    """(output tokens equal to the reference at the same position, reference tokens)."""
    same = total = 0
    for ref, out in zip(reference, outputs, strict=True):
        total += len(ref)
        same += sum(a == b for a, b in zip(ref, out, strict=False))
    return same, total


def section_profile(args: argparse.Namespace) -> None:
    """Where a verification step's time goes: one batch-1 request (a random SmolLM2-135M shape,
    fp32, a prompt of a repeating pattern so that n-gram always finds drafts) with and without
    n-gram speculation; per step the host time of `core.step()` and the tokens it produced,
    then cProfile's top functions and torch.profiler's top operators over the timed steps."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prompt = [7, 8, 9, 10, 11] * 120
    params = SamplingParams(max_tokens=args.profile_tokens, temperature=0.0, ignore_eos=True)
    limits = dict(dtype="float32", max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=1024)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 6,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    }
    for label, config in (("no speculation", None), ("n-gram strict K=6", spec)):
        core = make_core(args.profile_model, config, **limits)
        run(core, [prompt], params)  # warm-up: graphs, compilation
        for mode in ("steps", "cprofile", "torch"):
            _COUNTER[0] += 1
            core.add_request(EngineRequest(f"p{_COUNTER[0]}", list(prompt), params))
            times: list[float] = []
            produced: list[int] = []
            prof = cProfile.Profile() if mode == "cprofile" else None
            tprof = (
                torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                if mode == "torch" and torch.cuda.is_available()
                else None
            )
            if tprof is not None:
                tprof.__enter__()
            while core.has_unfinished_requests():
                began = time.perf_counter()
                if prof is not None:
                    prof.enable()
                deltas = core.step()
                if prof is not None:
                    prof.disable()
                times.append((time.perf_counter() - began) * 1e3)
                produced.append(sum(len(d.new_token_ids) for d in deltas))
            if tprof is not None:
                tprof.__exit__(None, None, None)
            if mode == "steps":
                busy = [(t, n) for t, n in zip(times, produced, strict=True) if n]
                record(
                    section="profile",
                    mode=label,
                    steps=len(times),
                    steps_with_tokens=len(busy),
                    tokens=sum(produced),
                    step_ms_p50=statistics.median(times),
                    step_ms_mean=statistics.fmean(times),
                    ms_per_token=sum(times) / max(1, sum(produced)),
                    first_steps_ms=[round(t, 3) for t in times[:12]],
                    first_steps_tokens=produced[:12],
                    **versions(),
                )
            elif prof is not None:
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
                print(f"== cProfile {label} (tottime) ==\n{out.getvalue()[-6000:]}", flush=True)
            elif tprof is not None:
                table = tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
                print(f"== torch.profiler {label} ==\n{table}", flush=True)
        free(core)


SECTIONS = {
    "synthetic": section_synthetic,
    "budget": section_budget,
    "editing": section_editing,
    "profile": section_profile,
}


# ---- prompt preparation (here, where the tokenizer loads) ----------------------------------------


def prepare(out: Path, gguf: Path, num: int) -> None:
    """Chat prompts asking to return a 500-1,000-token passage of this repository's docs with a
    small change, as token ids (the GPU machine has no GGUF tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    root = Path(__file__).resolve().parents[3]
    sources = sorted((root / "docs").glob("*.md")) + [root / "README.md"]
    paragraphs = [
        p.strip()
        for src in sources
        for p in src.read_text().split("\n\n")
        if len(p.strip()) > 80 and not p.lstrip().startswith(("|", "```"))
    ]
    passages, current = [], []
    for paragraph in paragraphs:
        current.append(paragraph)
        size = len(tokenizer.encode("\n\n".join(current)))
        if size >= 500:
            if size <= 1000:
                passages.append("\n\n".join(current))
            current = []
        if len(passages) == num:
            break
    prompts = []
    for passage in passages:
        messages = [{"role": "user", "content": EDIT_INSTRUCTION + passage}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append([int(t) for t in tokenizer.encode(text, add_special_tokens=False)])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prompts))
    lengths = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts, {min(lengths)}-{max(lengths)} tokens -> {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="davit_tools.bench.spec_decode")
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare")
    prep.add_argument("--out", type=Path, required=True)
    prep.add_argument("--smollm2-gguf", type=Path, default=None)
    prep.add_argument("--num", type=int, default=32)
    go = sub.add_parser("run")
    go.add_argument("--sections", default="synthetic,budget,editing")
    go.add_argument("--smollm2-gguf", type=Path, default=None)
    go.add_argument("--prompts", type=Path, default=Path(".device/editing_prompts.json"))
    go.add_argument("--editing-k", type=int, default=6)
    go.add_argument("--profile-model", default="random:smollm2-135m")
    go.add_argument("--profile-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        gguf = args.smollm2_gguf
        if gguf is None:
            from tests.support import reference_gguf

            gguf = reference_gguf()
        prepare(args.out, gguf, args.num)
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    failed = False
    for name in args.sections.split(","):
        began = time.perf_counter()
        try:
            SECTIONS[name](args)
        except Exception:  # a failed section is reported, and the next one runs
            failed = True
            traceback.print_exc()
            record(section=name, error=traceback.format_exc()[-2000:])
        print(f"section {name}: {time.perf_counter() - began:.1f} s", flush=True)
    print_table()
    return 1 if failed else 0


def print_table() -> None:
    print(
        "\nsection   batch  label                                    decode tok/s  TPOT ms  accept len  out tok/s"
    )
    for row in RESULTS:
        if "label" not in row:
            continue
        print(
            f"{row['section']:<9} {row['batch']:>5}  {row['label']:<40} {row['decode_tok_s']:>12}"
            f"  {row['mean_tpot_ms']:>7}  {row['acceptance_length']:>10}  {row['output_tok_s']:>9}"
            + (f"  differ {row['differing_share']}" if "differing_share" in row else "")
        )


if __name__ == "__main__":
    sys.exit(main())
