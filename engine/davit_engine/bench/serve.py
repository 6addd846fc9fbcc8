"""`davit bench serve`: online serving benchmark over HTTP against a running server.

Sends `--num-prompts` streaming `/v1/completions` requests whose prompts are random token ids
of exactly `--input-len` tokens (seeded, so runs are comparable), asking for `--output-len`
tokens with EOS ignored. Load is either a fixed `--concurrency` (closed loop) or a Poisson
`--request-rate` (open loop, requests/s). Works against any OpenAI-compatible server that
accepts token-id prompts and `ignore_eos` (Davit, upstream vLLM).

Per request it measures TTFT (send → first token), ITL (gaps between streamed outputs), TPOT
((end − first token) / (output tokens − 1)) and end-to-end latency; it reports p50/p99 and
means, output tokens/s over the whole run, and errors, with the configuration beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

import davit_engine


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    error: str = ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="davit bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="requests kept in flight")
    load.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, req/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="token ids are drawn below this (default: from /v1/engine/info, else 32000)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--output-json", default=None, help="also write config and results here")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be at least 1")
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("argument --concurrency: must be at least 1")
    if args.request_rate is not None and not args.request_rate > 0:
        parser.error("argument --request-rate: must be positive")
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 1
    if args.vocab_size is not None and args.vocab_size < 2:
        parser.error("argument --vocab-size: must be at least 2")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p99": percentile(values, 99)}


async def discover(http: httpx.AsyncClient) -> tuple[str | None, dict[str, Any]]:
    """The server's first model name and, on Davit, its engine info (empty elsewhere)."""
    name = None
    info: dict[str, Any] = {}
    response = await http.get("/v1/models")
    if response.status_code == 200 and response.json().get("data"):
        name = response.json()["data"][0]["id"]
    response = await http.get("/v1/engine/info")
    if response.status_code == 200:
        info = response.json().get("model_info", {})
    return name, info


async def one_request(
    http: httpx.AsyncClient, body: dict[str, Any], timeout_s: float
) -> RequestResult:
    start = time.perf_counter()
    first: float | None = None
    last: float | None = None
    itls: list[float] = []
    output_tokens = 0
    try:
        async with http.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                return RequestResult(False, error=f"HTTP {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"].get("message")))
                if chunk.get("usage"):
                    output_tokens = int(chunk["usage"]["completion_tokens"])
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                elif last is not None:
                    itls.append(now - last)
                last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if first is None:
        return RequestResult(False, error="the stream carried no output")
    return RequestResult(True, output_tokens, first - start, end - start, itls)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=max(args.concurrency or 0, 64))
    async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=30.0) as http:
        served, engine_info = await discover(http)
        model = args.model or served
        vocab = args.vocab_size or int(engine_info.get("vocab_size") or 32000)
        rng = random.Random(args.seed)
        prompts = [
            [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
        ]
        bodies = [
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.output_len,
                "temperature": args.temperature,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                "seed": args.seed + i,
            }
            for i, prompt in enumerate(prompts)
        ]
        arrivals = [0.0] * len(bodies)
        if args.request_rate is not None:
            t = 0.0
            for i in range(len(bodies)):
                arrivals[i] = t
                t += rng.expovariate(args.request_rate)
        gate = asyncio.Semaphore(args.concurrency or len(bodies))
        bench_start = time.perf_counter()

        async def scheduled(i: int) -> RequestResult:
            delay = bench_start + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                return await one_request(http, bodies[i], args.timeout)

        results = await asyncio.gather(*(scheduled(i) for i in range(len(bodies))))
        duration = time.perf_counter() - bench_start

    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return {
        "config": {
            "base_url": args.base_url,
            "model": model,
            "engine": engine_info,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "concurrency": args.concurrency,
            "request_rate": args.request_rate,
            "temperature": args.temperature,
            "seed": args.seed,
            "client": {
                "davit": davit_engine.__version__,
                "python": platform.python_version(),
                "httpx": httpx.__version__,
                "host": platform.node(),
            },
        },
        "results": {
            "completed": len(ok),
            "errors": len(errors),
            "error_examples": sorted(set(errors))[:5],
            "duration_s": duration,
            "request_throughput": len(ok) / duration,
            "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / duration,
            "total_tokens_per_s": (output_tokens + len(ok) * args.input_len) / duration,
            "ttft_s": summarize([r.ttft_s for r in ok]),
            "tpot_s": summarize(tpots),
            "itl_s": summarize([x for r in ok for x in r.itls_s]),
            "e2e_s": summarize([r.e2e_s for r in ok]),
        },
    }


def _print_report(report: dict[str, Any]) -> None:
    c, r = report["config"], report["results"]
    load = (
        f"concurrency {c['concurrency']}"
        if c["concurrency"] is not None
        else f"request rate {c['request_rate']:g}/s (Poisson)"
    )
    engine = c["engine"]
    print(f"davit bench serve: {c['base_url']} model {c['model']}")
    if engine:
        print(
            "engine: "
            + ", ".join(
                f"{k} {engine[k]}"
                for k in ("architecture", "dtype", "device", "runner", "num_blocks", "block_size")
                if k in engine
            )
        )
    print(
        f"workload: {c['num_prompts']} prompts, {c['input_len']} random tokens in, "
        f"{c['output_len']} out (EOS ignored), {load}, temperature {c['temperature']:g}, "
        f"seed {c['seed']}"
    )
    print(f"completed {r['completed']}, errors {r['errors']}, duration {r['duration_s']:.2f} s")
    for example in r["error_examples"]:
        print(f"  error: {example}")
    print(
        f"output tokens/s {r['output_tokens_per_s']:.2f}, total tokens/s "
        f"{r['total_tokens_per_s']:.2f}, requests/s {r['request_throughput']:.3f}"
    )
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        s = r[key]
        print(
            f"{label:5s} ms: mean {s['mean'] * 1e3:9.2f}  p50 {s['p50'] * 1e3:9.2f}  "
            f"p99 {s['p99'] * 1e3:9.2f}"
        )


def serve_bench_main(rest: list[str]) -> int:
    """Entry point of `davit bench serve`; 1 when no request succeeded, else 0."""
    parser = build_parser()
    args = parser.parse_args(rest)
    check_args(parser, args)
    try:
        report = asyncio.run(run(args))
    except httpx.HTTPError as exc:
        print(f"davit bench serve: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 1
    _print_report(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2, allow_nan=True)
    return 0 if report["results"]["completed"] else 1
