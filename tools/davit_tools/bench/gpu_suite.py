"""GPU validation and benchmarks of runner V2 in one process, for one call to the GPU machine.

Sections (pick with `--sections`, in this order):
- `tests`: the kernel and runner-V2 test suites on the GPU (pytest, `gpu` marks included);
- `kernels`: decode-attention bandwidth at the W1 and W2 shapes, against the copy bandwidth;
- `v1v2`: runner V2 (graphs and eager) against runner V1, greedy, fp32, token for token;
- `hf`: greedy completions against transformers on the same random weights (fp32 exact share,
  bf16 identical share) for a Qwen3 and a Llama shape;
- `parity`: fp32 greedy of a Llama, a Qwen2 and a Qwen3 shape (and SmolLM2's real weights with
  `--smollm2-gguf`) through runner V2 (CUDA graphs) and runner V1 against transformers
  `generate()`, and V2 against V1 token for token;
- `w1`, `w2`, `peer`: the workloads W1 and W2, and the transformers peer at one shape
  (`workloads.py` defines each);
- `profile`: where a decode step's time goes (torch.profiler, eager kernels) at the W1 shape;
- `async`: W1 and W2 through the engine's own step loop with asynchronous scheduling on and
  off, after a check that both give the same greedy tokens in fp32;
- `w3`: the HTTP server (`davit serve`, byte tokenizer) under `davit bench serve` load.

Every result is one JSON line in `$OUT/results.jsonl` with its configuration; a short table is
printed last. Nothing here imports the HTTP stack.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from davit_engine.config import EngineConfig
from davit_engine.core.batch import SchedulerOutput
from davit_engine.engine_core import EngineCore
from davit_engine.types import EngineRequest, SamplingParams
from davit_tools.bench.timing import graph_us
from davit_tools.bench.workloads import W1, W2, W3, OfflineWorkload, PeerShape, Warmup

RESULTS: list[dict[str, Any]] = []
OUT = Path(os.environ.get("OUT", "/tmp/davit-gpu-suite"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def record(kind: str, **fields: Any) -> dict[str, Any]:
    row = {"section": kind, **fields}
    RESULTS.append(row)
    with open(OUT / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def versions() -> dict[str, str]:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 20
    del a, b
    return 2 * n * 2 / seconds


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- engine driving ---------------------------------------------------------------------------


def make_core(
    model: str, runner: str, eager: bool, dtype: str, fuse: bool = True, **kw: Any
) -> EngineCore:
    from davit_engine.runner.v2 import RunnerV2

    RunnerV2.fuse_layers = fuse
    config = EngineConfig(
        model=model,
        dtype=dtype,  # type: ignore[arg-type]
        runner=runner,  # type: ignore[arg-type]
        enforce_eager=eager,
        enable_prefix_caching=False,
        seed=0,
        **kw,
    )
    return EngineCore(config)


def run_requests(
    core: EngineCore, requests: list[EngineRequest], deadline_s: float | None = None
) -> dict[str, Any]:
    """Drive schedule -> execute -> update until done; time the host and device parts."""
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    scheduler, runner = core.scheduler, core.runner
    for req in requests:
        core.add_request(req)
    torch.cuda.synchronize()
    t_schedule = t_execute = t_update = 0.0
    steps = decode_steps = 0
    first_token_at: float | None = None
    start = time.perf_counter()
    while scheduler.has_unfinished():
        t0 = time.perf_counter()
        batch = scheduler.schedule()
        t1 = time.perf_counter()
        result = runner.execute(batch)
        t2 = time.perf_counter()
        for delta in scheduler.update_from_output(batch, result):
            outputs[delta.request_id].extend(delta.new_token_ids)
            if first_token_at is None:
                first_token_at = time.perf_counter() - start
        t3 = time.perf_counter()
        t_schedule += t1 - t0
        t_execute += t2 - t1
        t_update += t3 - t2
        steps += 1
        decode_steps += all(r.num_new_tokens == 1 for r in batch.scheduled)
        if deadline_s is not None and t3 - start > deadline_s:
            break  # reported as partial: the figure covers only the tokens made so far
    elapsed = time.perf_counter() - start
    partial = scheduler.has_unfinished()
    if partial:
        core.abort_requests([r.request_id for r in requests])
        core.step()
    runner.execute(SchedulerOutput(finished_ids=list(outputs)))
    num_output = sum(len(v) for v in outputs.values())
    return {
        "outputs": outputs,
        "elapsed_s": round(elapsed, 3),
        "output_tokens": num_output,
        "output_tok_s": round(num_output / elapsed, 1),
        "partial": partial,
        "steps": steps,
        "decode_steps": decode_steps,
        "first_token_s": round(first_token_at or 0.0, 4),
        "host_schedule_ms_per_step": round(1e3 * t_schedule / max(steps, 1), 3),
        "execute_ms_per_step": round(1e3 * t_execute / max(steps, 1), 3),
        "host_update_ms_per_step": round(1e3 * t_update / max(steps, 1), 3),
    }


def random_requests(
    n: int,
    in_lens: list[int],
    out_lens: list[int],
    vocab: int,
    seed: int,
    temperature: float,
    prefix: str = "req",
) -> list[EngineRequest]:
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        prompt = torch.randint(0, vocab, (in_lens[i],), generator=gen).tolist()
        params = SamplingParams(
            max_tokens=out_lens[i], temperature=temperature, ignore_eos=True, seed=None
        )
        reqs.append(EngineRequest(f"{prefix}-{i}", prompt, params))
    return reqs


def workload_requests(workload: OfflineWorkload, vocab: int) -> list[EngineRequest]:
    """The workload's requests for a model with `vocab` token ids."""
    in_lens, out_lens = workload.lengths()
    return random_requests(
        workload.num_requests, in_lens, out_lens, vocab, workload.prompt_seed, workload.temperature
    )


def warmup_requests(vocab: int) -> list[EngineRequest]:
    """`Warmup`'s requests: run before a timed workload on the same engine."""
    warm = Warmup()
    n = len(warm.input_lens)
    return random_requests(
        n, list(warm.input_lens), [warm.output_len] * n, vocab, warm.prompt_seed,
        warm.temperature, prefix="warm",
    )  # fmt: skip


def w1_of(args: argparse.Namespace) -> W1:
    """W1 with the model and temperature given on the command line (W1's own by default)."""
    return replace(W1(), model=args.w1_model, temperature=args.temperature)


def w2_of(args: argparse.Namespace) -> W2:
    return replace(W2(), model=args.w2_model)


def runner_label(runner: str, eager: bool, fuse: bool = True) -> str:
    label = f"{runner}-{'eager' if eager or runner == 'v1' else 'graphs'}"
    return label if fuse or runner == "v1" else label + "-unfused"


# ---- sections ---------------------------------------------------------------------------------


def section_tests(_: argparse.Namespace) -> None:
    log = OUT / "pytest.log"
    began = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/engine/kernels",
            "tests/engine/runner/v2",
        ],
        capture_output=True,
        text=True,
    )
    log.write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    record("tests", rc=proc.returncode, summary=tail, seconds=round(time.perf_counter() - began))
    if proc.returncode != 0:
        print(proc.stdout[-6000:], flush=True)


def section_kernels(args: argparse.Namespace) -> None:
    from davit_engine.kernels.layer_ops import rms_norm, rms_norm_reference, silu_mul
    from davit_engine.kernels.paged_attention import default_num_splits, paged_attention
    from davit_engine.kernels.sampling import SamplingTable, sample

    bw = args.copy_bw
    record("copy_bandwidth", tb_s=round(bw / 1e12, 3))
    page = 16
    w1, w2 = W1(), W2()
    w1_shape, w2_shape = w1.shape(), w2.shape()
    cases = (
        ("w1-decode", w1.max_num_seqs, w1.decode_context, w1_shape),
        ("w2-decode", w2.num_requests, w2.floor_context, w2_shape),
        ("b64", 64, w2.max_model_len, w2_shape),  # a mid batch at full context, W2's heads
    )
    for label, batch, ctx, shape in cases:
        hq, hkv, dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        blocks_per_seq = -(-ctx // page)
        cache = torch.randn(
            2, batch * blocks_per_seq + 1, page, hkv, dim, device="cuda", dtype=torch.bfloat16
        )
        tables = torch.randperm(batch * blocks_per_seq, device="cuda").int().view(batch, -1)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16)
        kv_bytes = batch * ctx * hkv * dim * 2 * 2
        for splits in sorted({1, default_num_splits(batch, hkv, ctx, q.device), 8}):
            us = graph_us(
                functools.partial(
                    paged_attention, q, cache, tables, seq_lens, qsl, 1, dim**-0.5, splits
                )
            )
            record(
                "kernel_decode_attention",
                shape=label,
                batch=batch,
                context=ctx,
                heads=f"{hq}/{hkv}x{dim}",
                num_splits=splits,
                us_in_graph=round(us, 2),
                kv_mb=round(kv_bytes / 1e6, 1),
                achieved_tb_s=round(kv_bytes / (us * 1e-6) / 1e12, 3),
                share_of_copy_bw=round(kv_bytes / (us * 1e-6) / bw, 3),
            )
        del cache
    free_memory()
    # sampling at W1's full batch: greedy, plain temperature, and top-p rows (whole-row path)
    vocab, rows = w1_shape.vocab_size, w1.max_num_seqs
    logits = torch.randn(rows, vocab, device="cuda") * 3
    slots = torch.arange(rows, dtype=torch.int32, device="cuda")
    positions = torch.full((rows,), 500, dtype=torch.int32, device="cuda")
    for name, temperature, top_p in (
        ("greedy", 0.0, 1.0),
        ("t=1", 1.0, 1.0),
        ("t=1 top_p", 1.0, 0.9),
    ):
        table = SamplingTable(
            temperature=torch.full((rows,), temperature, device="cuda"),
            top_k=torch.zeros(rows, dtype=torch.int32, device="cuda"),
            top_p=torch.full((rows,), top_p, device="cuda"),
            min_p=torch.zeros(rows, device="cuda"),
            seed=slots.clone(),
        )
        filtered = top_p < 1.0
        draw = functools.partial(sample, logits, slots, positions, table, any_filtered=filtered)
        us = graph_us(draw, 10)
        record("kernel_sampling", rows=rows, vocab=vocab, mode=name, us_in_graph=round(us, 1))
    del logits
    # fused layer ops against the torch layers they replace, W1 decode shapes
    hidden, inter, eps = w1_shape.hidden_size, w1_shape.intermediate_size, w1_shape.rms_norm_eps
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
    for name, fused, plain in (
        (
            f"rms_norm {rows}x{hidden}",
            lambda: rms_norm(x, w, eps),
            lambda: rms_norm_reference(x, w, eps),
        ),
        (
            f"silu_mul {rows}x{inter}",
            lambda: silu_mul(gate_up),
            lambda: torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:],
        ),
    ):
        record(
            "kernel_layer_op",
            op=name,
            fused_us=round(graph_us(fused), 2),
            torch_us=round(graph_us(plain), 2),
        )
    free_memory()


def section_v1v2(args: argparse.Namespace) -> None:
    """Greedy fp32 on a random Qwen3-0.6B: V2 (graphs), V2 (eager) and V1, token for token."""
    model = args.small_model
    results: dict[str, dict[str, list[int]]] = {}
    for runner, eager in (("v1", True), ("v2", False), ("v2", True)):
        core = make_core(
            model,
            runner,
            eager,
            "float32",
            max_model_len=512,
            max_num_seqs=16,
            max_num_batched_tokens=512,
        )
        vocab = core.model_info.vocab_size
        gen = torch.Generator().manual_seed(1)
        in_lens = torch.randint(5, 200, (12,), generator=gen).tolist()
        reqs = random_requests(12, in_lens, [40] * 12, vocab, 11, temperature=0.0)
        res = run_requests(core, reqs)
        results[runner_label(runner, eager)] = res["outputs"]
        core.shutdown()
        del core
        free_memory()
    ref = results["v1-eager"]
    for label, outs in results.items():
        same = sum(outs[k] == ref[k] for k in ref)
        record(
            "v2_vs_v1_fp32",
            model=model,
            runner=label,
            identical_completions=f"{same}/{len(ref)}",
            tokens=sum(len(v) for v in outs.values()),
        )


def _hf_from_ours(core: EngineCore) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    from davit_engine.loader.hf_config import model_config_to_hf

    runner: Any = core.runner
    model = runner.model
    raw = model_config_to_hf(model.config)
    raw.pop("architectures")
    model_type = raw.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **raw)
    dtype = next(model.parameters()).dtype
    with torch.device(DEVICE):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in name), None)
        if fused is None:
            tensors[name] = param
            continue
        bounds = model._shard_bounds(fused)
        parts = ("q_proj", "k_proj", "v_proj") if fused == "qkv_proj" else ("gate_proj", "up_proj")
        for i, part in enumerate(parts):
            tensors[name.replace(f".{fused}.", f".{part}.")] = param[bounds[i] : bounds[i + 1]]
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not m.endswith("lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)
    if model.config.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


def section_hf(args: argparse.Namespace) -> None:
    """Greedy completions against transformers `generate()` on the same weights. Where one
    differs, the gap in transformers' own logits between its token and ours at the first
    difference says whether it is a near-tie that rounding can flip."""
    cases = [(args.small_model, "float32", "v2"), (args.small_model, "float32", "v1")]
    cases += [(args.small_model, "bfloat16", "v2")]
    cases += [(m, "bfloat16", "v2") for m in args.hf_models]
    for model, dtype, runner in cases:
        core = make_core(
            model, runner, False, dtype, max_model_len=256, max_num_seqs=16,
            max_num_batched_tokens=1024, gpu_memory_utilization=0.4,
        )  # fmt: skip
        vocab = core.model_info.vocab_size
        n, in_len, out_len = 16, 64, 32
        reqs = random_requests(n, [in_len] * n, [out_len] * n, vocab, 5, temperature=0.0)
        ours = run_requests(core, reqs)["outputs"]
        hf = _hf_from_ours(core)
        core.shutdown()
        del core
        free_memory()
        ids = torch.tensor([r.prompt_token_ids for r in reqs], device=DEVICE)
        # EOS ignored as on our side: no stop token, and no EOS masking (min_new_tokens would)
        hf.generation_config.eos_token_id = None
        with torch.inference_mode():
            out = hf.generate(
                ids, max_new_tokens=out_len, do_sample=False, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        theirs = out.sequences[:, in_len:].tolist()
        same = first = prefix = 0
        gaps = []
        for i, r in enumerate(reqs):
            a, b = ours[r.request_id], theirs[i]
            same += a == b
            first += a[0] == b[0]
            j = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            prefix += j
            if j < len(a):
                row = out.logits[j][i].float()
                gaps.append(float(row[b[j]] - row[a[j]]))
        del hf, out
        free_memory()
        record(
            "greedy_vs_transformers",
            model=model,
            dtype=dtype,
            runner=runner_label(runner, False),
            prompts=n,
            input_len=in_len,
            output_len=out_len,
            identical_completions=f"{same}/{n}",
            identical_first_token=f"{first}/{n}",
            mean_matching_prefix=round(prefix / n, 2),
            logit_gap_at_first_difference=[round(g, 5) for g in sorted(gaps)],
        )


# ---- parity: fp32 greedy of every family against transformers ---------------------------------

# Chat prompts for a checkpoint that carries a tokenizer and a chat template (SmolLM2's GGUF):
# short questions and a few longer ones, so prompt lengths vary and answers end on EOS or run on.
PARITY_CHAT = [
    "What is the capital of France?",
    "Name three fruits that are red.",
    "Write a haiku about the autumn wind.",
    "Explain in one sentence what a battery stores.",
    "What is 9 plus 16?",
    "How do I say 'thank you' in German?",
    "Who painted the Mona Lisa?",
    "Give me one tip for sleeping better, and tell me why it works for most people.",
    "What is the largest ocean on Earth?",
    "Describe a lighthouse to a child who has never seen the sea, in two sentences.",
    "What does a web browser do?",
    "Name a mammal that can fly.",
    "Why do leaves change colour in autumn? Keep the answer short and simple, please.",
    "Suggest a name for a bicycle repair shop.",
    "At what temperature in Celsius does water freeze?",
    "Tell the story of the tortoise and the hare in one sentence.",
]
REFERENCE_OURS = "transformers (our weights)"
REFERENCE_GGUF = "transformers (GGUF load)"


@dataclass(frozen=True)
class ParityPrompts:
    """Prompts of one parity run and how both sides treat EOS.

    `eos_token_ids` empty: EOS is ignored on both sides (every completion has `output_len`
    tokens). Otherwise both sides stop at the first of these ids, which ends the completion.
    """

    token_ids: list[list[int]]
    eos_token_ids: tuple[int, ...]
    input_len: str  # as recorded: "64" or "27-61 (chat template)"
    decode: Callable[[list[int]], str] | None = None

    @property
    def eos(self) -> str:
        if not self.eos_token_ids:
            return "ignored both sides"
        return f"honoured both sides: stop at {list(self.eos_token_ids)}"


def parity_prompts(model: str, num_prompts: int, input_len: int) -> ParityPrompts:
    """Chat prompts through the checkpoint's tokenizer for a GGUF file (EOS honoured); random
    prompts of `input_len` tokens for a random shape (EOS ignored, as in section `hf`)."""
    from davit_engine.loader import model_kind, read_model_config

    config = read_model_config(model)
    if model_kind(model) != "gguf":
        gen = torch.Generator().manual_seed(5)
        prompts = [
            torch.randint(0, config.vocab_size, (input_len,), generator=gen).tolist()
            for _ in range(num_prompts)
        ]
        return ParityPrompts(prompts, (), str(input_len))
    if num_prompts > len(PARITY_CHAT):
        raise ValueError(
            f"--parity-prompts: at most {len(PARITY_CHAT)} chat prompts exist, got {num_prompts}"
        )
    from davit_engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(EngineConfig(model=model))
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}])
        for q in PARITY_CHAT[:num_prompts]
    ]
    lengths = [len(p) for p in prompts]
    return ParityPrompts(
        prompts,
        config.eos_token_ids,
        f"{min(lengths)}-{max(lengths)} (chat template)",
        decode=tokenizer.decode,
    )


def greedy_ours(core: EngineCore, prompts: ParityPrompts, output_len: int) -> list[list[int]]:
    """Greedy completions through the engine's own step loop (asynchronous steps where the
    runner has them), one list of token ids per prompt, EOS included when it stopped one."""
    params = SamplingParams(
        max_tokens=output_len, temperature=0.0, ignore_eos=not prompts.eos_token_ids
    )
    reqs = [EngineRequest(f"parity-{i}", p, params) for i, p in enumerate(prompts.token_ids)]
    outputs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for req in reqs:
        core.add_request(req)
    while core.has_unfinished_requests():
        for delta in core.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
    return [outputs[r.request_id] for r in reqs]


def greedy_transformers(
    hf: Any, prompts: ParityPrompts, output_len: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers `generate()` greedy: (completions, logits [steps, vocab] per prompt).

    Prompts of one length go in one batch; otherwise one at a time, so no padding ever enters
    a row. EOS is treated as `prompts.eos_token_ids` says (no stop token and no EOS masking
    when ignored); a completion stopped by EOS ends with it.
    """
    eos = list(prompts.eos_token_ids)
    hf.generation_config.eos_token_id = eos or None
    device = next(hf.parameters()).device
    count = len(prompts.token_ids)
    same_length = len({len(p) for p in prompts.token_ids}) == 1
    groups = [list(range(count))] if same_length else [[i] for i in range(count)]
    tokens: list[list[int]] = [[] for _ in range(count)]
    logits: list[torch.Tensor] = [torch.empty(0) for _ in range(count)]
    for group in groups:
        ids = torch.tensor([prompts.token_ids[i] for i in group], device=device)
        with torch.inference_mode():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                do_sample=False, temperature=None, top_p=None, top_k=None,
                pad_token_id=eos[0] if eos else 0, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        steps = torch.stack(out.logits, dim=1).float()  # [group, steps, vocab]
        for row, i in enumerate(group):
            seq = out.sequences[row, ids.shape[1] :].tolist()
            end = next((j + 1 for j, t in enumerate(seq) if t in eos), len(seq))
            tokens[i] = seq[:end]
            logits[i] = steps[row, :end]
        del out, steps
    return tokens, logits


def compare_greedy(
    ours: list[list[int]],
    theirs: list[list[int]],
    their_logits: list[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Agreement of two sets of greedy completions, prompt by prompt.

    Where a completion differs, `their_logits` (the reference's logits at each step) give the
    gap between the reference's token and ours at the first difference: a gap near zero is a
    near-tie that rounding can flip; a large one is a real divergence.
    """
    count = len(ours)
    same = first = prefix = 0
    positions: list[list[int]] = []  # [prompt, token index] of each first difference
    gaps: list[float] = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        same += a == b
        first += bool(a) and bool(b) and a[0] == b[0]
        shorter = min(len(a), len(b))
        j = next((j for j in range(shorter) if a[j] != b[j]), shorter)
        prefix += j
        if a == b:
            continue
        positions.append([i, j])
        if their_logits is not None and j < shorter:
            row = their_logits[i][j]
            gaps.append(float(row[b[j]] - row[a[j]]))
    result: dict[str, Any] = {
        "identical_completions": f"{same}/{count}",
        "identical_first_token": f"{first}/{count}",
        "mean_matching_prefix": round(prefix / max(count, 1), 2),
        "mean_output_tokens": round(sum(len(a) for a in ours) / max(count, 1), 2),
        "first_difference_at": positions,
    }
    if their_logits is not None:
        result["logit_gap_at_first_difference"] = [round(g, 5) for g in sorted(gaps)]
    return result


def _hf_from_gguf(path: Path) -> Any:
    """transformers' own load of a GGUF file (its dequantization, its name mapping), fp32."""
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return hf.to(DEVICE).eval()


def parity_model(
    model: str,
    runners: list[tuple[str, bool, bool]],
    num_prompts: int,
    input_len: int,
    output_len: int,
) -> None:
    """fp32 greedy of `model` through each runner against transformers, and runner against
    runner. transformers runs on our loaded weights (`_hf_from_ours`) and, for a GGUF file,
    also on its own load of the file. One core or one transformers model is alive at a time
    beside the model being converted."""
    import transformers

    from davit_engine.loader import model_kind

    prompts = parity_prompts(model, num_prompts, input_len)
    block = EngineConfig(model=model).block_size
    longest = max(len(p) for p in prompts.token_ids) + output_len
    max_model_len = -(-longest // block) * block
    ours: dict[str, list[list[int]]] = {}
    runs: dict[str, dict[str, Any]] = {}
    refs: dict[str, tuple[list[list[int]], list[torch.Tensor]]] = {}
    for runner, eager, fuse in runners:
        label = runner_label(runner, eager, fuse)
        core = make_core(
            model, runner, eager, "float32", fuse=fuse, max_model_len=max_model_len,
            max_num_seqs=num_prompts, max_num_batched_tokens=max(1024, max_model_len),
            num_gpu_blocks=num_prompts * max_model_len // block + 1,
        )  # fmt: skip
        ours[label] = greedy_ours(core, prompts, output_len)
        runs[label] = {
            "graph_steps": getattr(core.runner, "num_graph_steps", None),
            "async_scheduling": core.model_info.async_scheduling,
        }
        hf = _hf_from_ours(core) if not refs else None
        core.shutdown()
        del core
        free_memory()
        if hf is not None:
            refs[REFERENCE_OURS] = greedy_transformers(hf, prompts, output_len)
            del hf
            free_memory()
    if model_kind(model) == "gguf":
        try:
            hf = _hf_from_gguf(Path(model))
        except ImportError as exc:  # transformers' GGUF reader needs the `gguf` package
            record("parity_note", model=model, reference=REFERENCE_GGUF, skipped=str(exc)[:300])
        else:
            refs[REFERENCE_GGUF] = greedy_transformers(hf, prompts, output_len)
            del hf
            free_memory()
    common = {
        "model": model,
        "dtype": "float32",
        "prompts": num_prompts,
        "input_len": prompts.input_len,
        "output_len": output_len,
        "eos": prompts.eos,
    }
    for label, completions in ours.items():
        for reference, (tokens, logits) in refs.items():
            sample = {}
            if prompts.decode is not None:
                sample = {"sample": prompts.decode(completions[0])[:200]}
            record(
                "parity_vs_transformers",
                **common,
                runner=label,
                reference=reference,
                transformers=transformers.__version__,
                **runs[label],
                **compare_greedy(completions, tokens, logits),
                **sample,
            )
    labels = list(ours)
    for other in labels[1:]:
        record(
            "parity_between_runners",
            **common,
            runners=f"{other} vs {labels[0]}",
            **compare_greedy(ours[other], ours[labels[0]]),
        )
    if len(refs) == 2:
        record(
            "parity_between_references",
            **common,
            references=f"{REFERENCE_GGUF} vs {REFERENCE_OURS}",
            **compare_greedy(refs[REFERENCE_GGUF][0], *refs[REFERENCE_OURS]),
        )


def section_parity(args: argparse.Namespace) -> None:
    """fp32 greedy of every family (and SmolLM2's real weights when given) through runner V2
    (CUDA graphs) and runner V1 against transformers `generate()`, and V2 against V1."""
    models = list(args.parity_models)
    if args.smollm2_gguf:
        if Path(args.smollm2_gguf).is_file():
            models.append(args.smollm2_gguf)
        else:
            record("parity_note", model=args.smollm2_gguf, skipped="--smollm2-gguf: no such file")
    for model in models:
        try:
            parity_model(
                model,
                args.parity_runners,
                args.parity_prompts,
                args.parity_input_len,
                args.parity_output_len,
            )
        except Exception as exc:  # one model's failure must not cost the other models' rows
            record("error", failed=f"parity {model}", error=f"{type(exc).__name__}: {exc}"[:2000])
            traceback.print_exc()
        free_memory()


def _throughput(
    label: str,
    model: str,
    runner: str,
    eager: bool,
    reqs_fn: Callable[[int], list[EngineRequest]],
    fuse: bool = True,
    deadline_s: float | None = None,
    **kw: Any,
) -> dict[str, Any]:
    core = make_core(model, runner, eager, "bfloat16", fuse=fuse, **kw)
    reqs = reqs_fn(core.model_info.vocab_size)
    # warm-up: a few short requests compile every prefill kernel variant before timing
    run_requests(core, warmup_requests(core.model_info.vocab_size))
    res = run_requests(core, reqs, deadline_s)
    res.pop("outputs")
    runner_obj: Any = core.runner
    row = record(
        label,
        model=model,
        runner=runner_label(runner, eager, fuse),
        dtype="bfloat16",
        requests=len(reqs),
        graph_steps=getattr(runner_obj, "num_graph_steps", None),
        **{k: v for k, v in kw.items() if k.startswith("max_")},
        **res,
        **versions(),
    )
    core.shutdown()
    del core
    free_memory()
    return row


def section_w1_v1(args: argparse.Namespace) -> None:
    """W1 on runner V1, last: it is the slow path (capped by --deadline-s)."""
    section_w1(argparse.Namespace(**{**vars(args), "w1_runners": [("v1", True, True)]}))


def section_w1(args: argparse.Namespace) -> None:
    w1 = w1_of(args)
    for runner, eager, fuse in args.w1_runners:
        _throughput(
            "w1",
            w1.model,
            runner,
            eager,
            functools.partial(workload_requests, w1),
            fuse=fuse,
            deadline_s=args.deadline_s if runner == "v1" else None,
            **w1.engine_limits(),
        )


def section_w2(args: argparse.Namespace) -> None:
    bw = copy_bandwidth()
    w2 = w2_of(args)
    for runner, eager, fuse in args.w2_runners:
        row = _throughput(
            "w2",
            w2.model,
            runner,
            eager,
            functools.partial(workload_requests, w2),
            fuse=fuse,
            **w2.engine_limits(),
        )
        floor_tok_s = args.copy_bw / w2.bytes_per_decode_step()
        decode_s = row["elapsed_s"] - row["first_token_s"]
        decode_tok_s = w2.decode_tokens / decode_s
        record(
            "w2_vs_floor",
            runner=row["runner"],
            copy_tb_s=round(args.copy_bw / 1e12, 3),
            copy_tb_s_this_section=round(bw / 1e12, 3),
            floor_tok_s=round(floor_tok_s, 1),
            output_tok_s=row["output_tok_s"],
            decode_tok_s=round(decode_tok_s, 1),
            share_of_floor=round(decode_tok_s / floor_tok_s, 3),
            ttft_s=row["first_token_s"],
        )


def section_peer(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.peer_dir)
    import peer_hf  # the shared peer script, carried beside the repository

    peer = replace(PeerShape(), model=args.w1_model)
    n, in_len, out_len = peer.num_requests, peer.input_len[0], peer.output_len[0]
    ours = _throughput(
        "peer_shape_ours",
        peer.model,
        "v2",
        False,
        functools.partial(workload_requests, peer),
        **peer.engine_limits(),
    )
    theirs = peer_hf.hf(peer.peer_model, [n], inp=in_len, out=out_len)[0]
    free_memory()
    record(
        "peer_ratio",
        shape=f"{peer.peer_model} bf16 batch {n}, {in_len} in / {out_len} out, greedy",
        ours_tok_s=ours["output_tok_s"],
        transformers_tok_s=theirs["output_tok_s"],
        ratio=round(ours["output_tok_s"] / theirs["output_tok_s"], 2),
    )


def _profile_decode(
    label: str, model: str, batch: int, in_len: int, eager: bool, fuse: bool, temperature: float
) -> None:
    """torch.profiler over 10 decode-only steps at `batch` requests of context ~`in_len`."""
    from torch.profiler import ProfilerActivity, profile

    core = make_core(
        model, "v2", eager, "bfloat16", fuse=fuse, max_num_seqs=max(batch, 8),
        max_num_batched_tokens=8192, max_model_len=2048,
    )  # fmt: skip
    vocab = core.model_info.vocab_size
    reqs = random_requests(batch, [in_len] * batch, [40] * batch, vocab, 3, temperature)
    for req in reqs:
        core.add_request(req)
    sched, runner = core.scheduler, core.runner

    def step() -> bool:
        batch_out = sched.schedule()
        sched.update_from_output(batch_out, runner.execute(batch_out))
        return len(batch_out.scheduled) == batch and batch_out.num_batched_tokens == batch

    decode_seen = 0
    while decode_seen < 3 and sched.has_unfinished():  # past the prefill, a few decode steps
        decode_seen += step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - began) / 10
    averages = prof.key_averages()
    name = f"profile_{label}_{runner_label('v2', eager, fuse)}.txt"
    (OUT / name).write_text(averages.table(sort_by="self_cuda_time_total", row_limit=30))
    kernels = [e for e in averages if e.self_device_time_total > 0 and e.device_type.name == "CUDA"]
    gpu_us = sum(e.self_device_time_total for e in kernels) / 10
    launches = sum(e.count for e in kernels) / 10
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
    record(
        "profile_decode",
        shape=label,
        model=model,
        batch=batch,
        context=in_len,
        runner=runner_label("v2", eager, fuse),
        wall_ms_per_step=round(wall * 1e3, 3),
        gpu_kernel_ms_per_step=round(gpu_us / 1e3, 3),
        kernels_per_step=round(launches, 1),
        top_kernels_ms={e.key[:50]: round(e.self_device_time_total / 10 / 1e3, 3) for e in top},
    )
    while sched.has_unfinished():
        step()
    core.shutdown()
    del core
    free_memory()


def _decode_ceiling(label: str, model: str, batch: int, in_len: int, temperature: float) -> None:
    """Decode steps issued back to back through `execute_async`, without waiting for tokens:
    the step time an engine loop that overlaps scheduling with the GPU (async scheduling) would
    see, against the measured synchronous loop."""
    core = make_core(
        model, "v2", False, "bfloat16", max_num_seqs=max(batch, 8),
        max_num_batched_tokens=8192, max_model_len=2048,
    )  # fmt: skip
    vocab = core.model_info.vocab_size
    reqs = random_requests(batch, [in_len] * batch, [200] * batch, vocab, 3, temperature)
    for req in reqs:
        core.add_request(req)
    sched, runner = core.scheduler, core.runner
    runner_v2: Any = runner
    sync_times: list[float] = []
    last = None
    while len(sync_times) < 20:  # past the prefill; then 20 synchronous decode steps, timed
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        if len(out.scheduled) == batch and out.num_batched_tokens == batch:
            sync_times.append(time.perf_counter() - t0)
            last = out
    assert last is not None
    # Re-issue the last decode step (same rows, same positions, same KV slots) 50 times.
    runner_v2.execute_async(last).result()
    torch.cuda.synchronize()
    began = time.perf_counter()
    pending = [runner_v2.execute_async(last) for _ in range(50)]
    pending[-1].result()
    async_step = (time.perf_counter() - began) / 50
    sync_step = sorted(sync_times)[len(sync_times) // 2]
    record(
        "decode_step_async_ceiling",
        shape=label,
        model=model,
        batch=batch,
        context=in_len + 20,
        runner="v2-graphs",
        sync_loop_ms_per_step=round(sync_step * 1e3, 3),
        back_to_back_ms_per_step=round(async_step * 1e3, 3),
        sync_loop_tok_s=round(batch / sync_step, 1),
        back_to_back_tok_s=round(batch / async_step, 1),
    )
    core.abort_requests([r.request_id for r in reqs])
    core.step()
    core.shutdown()
    del core
    free_memory()


def section_ceiling(args: argparse.Namespace) -> None:
    # Prompts a little shorter than the workloads' mean decode contexts: the ceiling is
    # measured after the prefill and 20 timed decode steps.
    w1, w2 = w1_of(args), w2_of(args)
    _decode_ceiling(f"w2-b{w2.num_requests}", w2.model, w2.num_requests, 1100, w2.temperature)
    _decode_ceiling(f"w1-b{w1.max_num_seqs}", w1.model, w1.max_num_seqs, 600, w1.temperature)


def section_profile(args: argparse.Namespace) -> None:
    """Where a decode step's time goes: W1's full batch (graphs + fused layers, and eager with
    the torch layers) and W2's single request; `--profile-shapes` picks among w1, w1-eager, w2."""
    shapes = args.profile_shapes.split(",")
    w1, w2 = w1_of(args), w2_of(args)
    batch = w1.max_num_seqs
    for shape, eager, fuse in (("w1", False, True), ("w1-eager", True, False)):
        if shape in shapes:
            _profile_decode(f"w1-b{batch}", w1.model, batch, 600, eager, fuse, w1.temperature)
    if "w2" in shapes:
        _profile_decode(
            f"w2-b{w2.num_requests}", w2.model, w2.num_requests, w2.input_len[0], False, True,
            w2.temperature,
        )  # fmt: skip


def _engine_loop(core: EngineCore, requests: list[EngineRequest]) -> dict[str, Any]:
    """Drive `core.step()` (the engine's own loop, async or not) to the end; time it."""
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for req in requests:
        core.add_request(req)
    torch.cuda.synchronize()
    steps = 0
    first_token_at: float | None = None
    start = time.perf_counter()
    while core.has_unfinished_requests():
        for delta in core.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
            if first_token_at is None:
                first_token_at = time.perf_counter() - start
        steps += 1
    elapsed = time.perf_counter() - start
    num_output = sum(len(v) for v in outputs.values())
    return {
        "outputs": outputs,
        "elapsed_s": round(elapsed, 3),
        "output_tokens": num_output,
        "output_tok_s": round(num_output / elapsed, 1),
        "steps": steps,
        "first_token_s": round(first_token_at or 0.0, 4),
    }


def section_async(args: argparse.Namespace) -> None:
    # Same greedy tokens with and without async steps (fp32, small model, stops and lengths).
    outputs = {}
    for on in (False, True):
        core = make_core(
            args.small_model,
            "v2",
            False,
            "float32",
            async_scheduling=on,
            max_num_seqs=16,
            max_num_batched_tokens=512,
            max_model_len=1024,
        )
        vocab = core.model_info.vocab_size
        gen = torch.Generator().manual_seed(3)
        reqs = [
            EngineRequest(
                f"a{i}",
                torch.randint(0, vocab, (int(n),), generator=gen).tolist(),
                SamplingParams(max_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True),
            )
            for i, n in enumerate(torch.randint(5, 600, (24,), generator=gen))
        ]
        outputs[on] = _engine_loop(core, reqs)["outputs"]
        assert core.model_info.async_scheduling == on
        core.shutdown()
        del core
        free_memory()
    same = sum(outputs[False][k] == outputs[True][k] for k in outputs[False])
    record("async_vs_sync_fp32", model=args.small_model, identical=f"{same}/{len(outputs[False])}")

    for name in ("w1", "w2"):
        for on in (False, True):
            res = _engine_workload(args, name, async_scheduling=on)
            res.pop("outputs")
            record(
                f"{name}_async" if on else f"{name}_sync",
                runner="v2-graphs",
                async_scheduling=on,
                dtype="bfloat16",
                **res,
            )


def _engine_workload(args: argparse.Namespace, name: str, **core_kw: Any) -> dict[str, Any]:
    """W1 or W2 through the engine loop (V2 graphs, bf16) on a fresh engine, after a short
    warm-up on it: `_engine_loop`'s figures plus the configuration (and W2's decode rate)."""
    workload: OfflineWorkload = w1_of(args) if name == "w1" else w2_of(args)
    core = make_core(workload.model, "v2", False, "bfloat16", **workload.engine_limits(), **core_kw)
    try:
        vocab = core.model_info.vocab_size
        _engine_loop(core, warmup_requests(vocab))
        res = _engine_loop(core, workload_requests(workload, vocab))
    finally:
        core.shutdown()
        del core
        free_memory()
    res.update(
        model=workload.model,
        requests=workload.num_requests,
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.max_num_batched_tokens,
    )
    if isinstance(workload, W2):
        decode = round(workload.decode_tokens / (res["elapsed_s"] - res["first_token_s"]), 1)
        res.update(decode_tok_s=decode, floor_share=round(decode / args.w2_floor, 3))
    return res


def section_pdl(args: argparse.Namespace) -> None:
    """W2 and W1 (async engine loop, V2 graphs) with programmatic dependent launch set by each
    of `--pdl-values` (`DAVIT_PDL`); W2's greedy tokens must not change."""
    from davit_engine.kernels import pdl
    from davit_engine.kernels.pdl import PDL_ENV

    before = os.environ.get(PDL_ENV)
    try:
        for name in args.pdl_workloads.split(","):
            first: dict[str, list[int]] | None = None
            for value in args.pdl_values.split(","):
                os.environ[PDL_ENV] = value
                pdl.refresh()
                res = _engine_workload(args, name)
                outputs = res.pop("outputs")
                if name == "w2":
                    first = first if first is not None else outputs
                    res["same_tokens_as_first"] = outputs == first
                record(f"{name}_pdl", runner="v2-graphs", async_scheduling=True,
                       pdl=value != "0", **res)  # fmt: skip
    finally:
        if before is None:
            os.environ.pop(PDL_ENV, None)
        else:
            os.environ[PDL_ENV] = before
        pdl.refresh()


def section_w3(args: argparse.Namespace) -> None:
    """W3: `davit serve` in a subprocess, `davit bench serve` at each concurrency, per runner;
    the served model is `--w1-model` (W3's own by default)."""
    for i, runner in enumerate(args.w3_runners.split(",")):
        _w3_one(args, runner, 8765 + i)


W3_RUNNER_FLAGS = {
    "v2-graphs": ["--runner", "v2"],
    "v2-eager": ["--runner", "v2", "--enforce-eager"],
    "v2-graphs-sync": ["--runner", "v2", "--no-async-scheduling"],
    "v1": ["--runner", "v1"],
}


def _w3_one(args: argparse.Namespace, runner: str, port: int) -> None:
    import urllib.request

    w3 = W3()
    base_url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(OUT / f"w3_server_{runner}.log", "w")  # noqa: SIM115 - closed after the server stops
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "davit_cli",
            "serve",
            *w3.serve_args(args.w1_model, port),
            "--log-level",
            "warning",
            *W3_RUNNER_FLAGS[runner],
        ],  # fmt: skip
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.perf_counter() + 150
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"davit serve did not become ready (see w3_server_{runner}.log)")
            time.sleep(1)
        # one short run first: Triton compiles the eager kernels on first use, not timed
        subprocess.run(
            [sys.executable, "-m", "davit_cli", "bench", "serve", *w3.warmup_args(base_url)],
            check=True, env=env, timeout=120, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        for concurrency, num in w3.loads_for(runner):
            out_json = OUT / f"w3_{runner}_c{concurrency}.json"
            subprocess.run(
                [
                    sys.executable, "-m", "davit_cli", "bench", "serve",
                    *w3.bench_args(base_url, concurrency, num), "--output-json", str(out_json),
                ],
                check=True, env=env, timeout=120,
            )  # fmt: skip
            result = json.loads(out_json.read_text())
            r = result.get("results", result)
            record(
                "w3",
                model=args.w1_model,
                concurrency=concurrency,
                num_prompts=num,
                input_len=w3.input_len,
                output_len=w3.output_len,
                runner=runner,
                async_scheduling=runner in ("v2-graphs", "v2-eager"),
                **{k: r.get(k) for k in ("ttft_s", "tpot_s", "itl_s", "output_tokens_per_s")},
                # whether the load generator kept up (a busy client reads late, in bursts)
                **{
                    k: r.get(k)
                    for k in ("tokens_per_chunk", "client_cpu_util", "client_cpu_us_per_token")
                },
            )
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "tests": section_tests,
    "kernels": section_kernels,
    "v1v2": section_v1v2,
    "hf": section_hf,
    "parity": section_parity,
    "w1": section_w1,
    "w1v1": section_w1_v1,
    "w2": section_w2,
    "peer": section_peer,
    "profile": section_profile,
    "ceiling": section_ceiling,
    "async": section_async,
    "w3": section_w3,
    "pdl": section_pdl,
}


def _runner_list(text: str) -> list[tuple[str, bool, bool]]:
    # "v2-graphs,v2-eager-unfused,v1" -> [(runner, eager, fuse), ...]
    out = []
    for item in text.split(","):
        runner, _, mode = item.partition("-")
        out.append((runner, runner == "v1" or mode.startswith("eager"), "unfused" not in mode))
    return out


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sections", default="tests,kernels,v1v2,hf,w1,w2")
    parser.add_argument("--small-model", default="random:qwen3-0.6b")
    parser.add_argument("--hf-models", default="random:llama-3.1-8b")
    parser.add_argument(
        "--w1-model", default=W1().model, help="W1's model; also the peer's and W3's"
    )
    parser.add_argument("--w2-model", default=W2().model)
    parser.add_argument("--w1-runners", default="v2-graphs")
    parser.add_argument("--w2-runners", default="v2-graphs")
    parser.add_argument(
        "--w3-runners", default="v2-graphs", help="v2-graphs,v2-eager,v2-graphs-sync,v1"
    )
    parser.add_argument("--profile-shapes", default="w1,w1-eager,w2")
    parser.add_argument("--pdl-workloads", default="w2,w1", help="pdl section: w2, w1")
    parser.add_argument(
        "--w2-floor",
        type=float,
        default=W2().measured_floor_tok_s,
        help="W2 bandwidth floor, decode tok/s (async and pdl sections)",
    )
    parser.add_argument("--pdl-values", default="0,1,0,1", help="DAVIT_PDL values, pdl section")
    parser.add_argument("--temperature", type=float, default=W1().temperature, help="W1's")
    parser.add_argument("--peer-dir", default=".device_bench")
    parser.add_argument("--deadline-s", type=float, default=None, help="cap on one W1 run")
    parser.add_argument(
        "--parity-models", default="random:llama-3.2-1b,random:qwen2.5-0.5b,random:qwen3-0.6b"
    )
    parser.add_argument("--parity-runners", default="v2-graphs,v1", help="first is the baseline")
    parser.add_argument("--parity-prompts", type=_positive_int, default=16)
    parser.add_argument("--parity-input-len", type=_positive_int, default=64, help="random shapes")
    parser.add_argument("--parity-output-len", type=_positive_int, default=32)
    parser.add_argument(
        "--smollm2-gguf", default=None, help="SmolLM2-135M-Instruct GGUF: also run `parity` on it"
    )
    args = parser.parse_args(argv)
    args.parity_models = [m for m in args.parity_models.split(",") if m]
    args.parity_runners = _runner_list(args.parity_runners)
    args.hf_models = [m for m in args.hf_models.split(",") if m]
    args.w1_runners = _runner_list(args.w1_runners)
    args.w2_runners = _runner_list(args.w2_runners)
    OUT.mkdir(parents=True, exist_ok=True)
    record("environment", **versions(), argv=sys.argv[1:])
    # The floor uses the best copy bandwidth seen in this process (the measurement varies).
    args.copy_bw = max(copy_bandwidth(), copy_bandwidth()) if torch.cuda.is_available() else 0.0
    for name in args.sections.split(","):
        began = time.perf_counter()
        try:
            SECTIONS[name](args)
        except Exception as exc:  # one broken section must not cost the call's other figures
            record("error", failed=name, error=f"{type(exc).__name__}: {exc}"[:2000])
            import traceback

            traceback.print_exc()
        print(f"[{name}] {time.perf_counter() - began:.1f} s", flush=True)
    print("\n==== summary ====")
    for row in RESULTS:
        keep = {k: v for k, v in row.items() if k not in ("torch", "triton", "gpu", "argv")}
        print(json.dumps(keep)[:400])
    return 0


if __name__ == "__main__":
    sys.exit(main())
