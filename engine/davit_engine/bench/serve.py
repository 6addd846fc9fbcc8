"""`davit bench serve`: online serving benchmark over HTTP against a running server.

Sends `--num-prompts` streaming `/v1/completions` requests whose prompts are random token ids
of exactly `--input-len` tokens (seeded, so runs are comparable), asking for `--output-len`
tokens with EOS ignored. Load is either a fixed `--concurrency` (closed loop) or a Poisson
`--request-rate` (open loop, requests/s). Works against any OpenAI-compatible server that
accepts token-id prompts and `ignore_eos` (Davit, upstream vLLM).

Per request it measures TTFT (send → first chunk with output), TPOT ((end − first chunk) /
(output tokens − 1)), ITL and end-to-end latency; it reports p50/p99 and means, output tokens/s
over the whole run, and errors, with the configuration beside them. Output tokens are counted
from the usage the server sends at the end of the stream (`include_usage`).

A chunk may carry several tokens (the server sends whatever arrived since its last write), so
ITL is per token: a chunk of n tokens that arrives g seconds after the previous one counts as
n gaps of g / n; tokens that share the first chunk are part of TTFT and have no ITL. Each
chunk's token count is exact when the server sends usage in every chunk
(`--continuous-usage-stats`); otherwise the total is shared out in proportion to the chunks'
text lengths (exact for a tokenizer of one character per token).

The client must not be what limits the run: the streams are read by the lean reader of
`bench.sse_client`, optionally spread over `--workers` processes, and the client's CPU time per
output token is reported, with a warning when a client process was busy most of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import httpx

import davit_engine
from davit_engine.bench.sse_client import (
    ConnectionPool,
    Endpoint,
    HTTPStatusError,
    parse_completion_chunk,
)

ITL_DEFINITION = (
    "per output token after the first chunk: a chunk of n tokens arriving g after the "
    "previous chunk counts as n gaps of g/n"
)
# A client process busier than this share of the run may have delayed what it measured.
SATURATED_UTIL = 0.8


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    error: str = ""
    num_chunks: int = 0


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
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="client processes, each with its own event loop and connections (default 1)",
    )
    p.add_argument(
        "--continuous-usage-stats",
        action="store_true",
        help="ask for usage in every chunk (an upstream vLLM extension) for exact per-chunk "
        "token counts; without it the total is shared out by text length",
    )
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
    if args.workers < 1:
        parser.error("argument --workers: must be at least 1")
    if args.concurrency is not None and args.workers > args.concurrency:
        parser.error(
            f"argument --workers: must not exceed --concurrency ({args.concurrency}): "
            "each worker keeps at least one request in flight"
        )
    try:
        Endpoint.from_url(args.base_url)
    except ValueError as exc:
        parser.error(f"argument --base-url: {exc}")


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


# --- tokens per chunk and ITL (pure) -------------------------------------------------------------


def chunk_token_counts(
    text_lengths: list[int], total: int, cumulative: list[int] | None = None
) -> list[int]:
    """How many of the stream's `total` output tokens each chunk with output carried.

    With `cumulative` (the usage's completion_tokens sent with every chunk) the counts are its
    differences, and tokens the final usage counts beyond the last chunk's (tokens without
    text) go to the last chunk. Otherwise every chunk gets one token and the rest are shared
    out in proportion to each chunk's text beyond one character (largest remainder), which is
    exact when every token is one character; evenly when no chunk has more than one.
    ValueError when the counts cannot add up to `total`.
    """
    if cumulative is not None:
        counts = [b - a for a, b in zip([0, *cumulative], cumulative, strict=False)]
        if not counts or min(counts) < 0 or cumulative[-1] > total:
            raise ValueError(f"per-chunk usage {cumulative} does not rise to {total} tokens")
        counts[-1] += total - cumulative[-1]
        return counts
    extra = total - len(text_lengths)
    if extra < 0:
        raise ValueError(f"{len(text_lengths)} chunks with output but only {total} tokens")
    weights = [max(n - 1, 0) for n in text_lengths]
    if not any(weights):
        weights = [1] * len(text_lengths)
    weight = sum(weights)
    shares = [extra * w / weight for w in weights]
    counts = [1 + math.floor(s) for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: math.floor(shares[i]) - shares[i])
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def token_itls(arrivals: list[float], counts: list[int]) -> list[float]:
    """Per-token ITL: a chunk of n tokens g after the last chunk with tokens gives n × g/n.

    The first chunk's tokens have no ITL (they arrived with the first token: TTFT); a chunk
    of no tokens (text of tokens counted earlier) adds none and does not restart the gap.
    """
    itls: list[float] = []
    last: float | None = None
    for arrived, count in zip(arrivals, counts, strict=True):
        if count == 0:
            continue
        if last is not None:
            itls.extend([(arrived - last) / count] * count)
        last = arrived
    return itls


class _StreamRecorder:
    """One request's stream: arrival time, text length and usage of every chunk with output."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.text_lengths: list[int] = []
        self.cumulative: list[int] = []
        self.output_tokens: int | None = None
        self.error = ""

    def on_event(self, data: bytes, arrived: float) -> bool:
        chunk = parse_completion_chunk(data)
        if chunk is None:
            return True
        if chunk.error is not None:
            self.error = chunk.error
            return False
        if chunk.completion_tokens is not None:
            self.output_tokens = chunk.completion_tokens
        if not chunk.text:
            return True
        self.arrivals.append(arrived)
        self.text_lengths.append(len(chunk.text))
        if chunk.completion_tokens is not None:
            self.cumulative.append(chunk.completion_tokens)
        return True

    def result(self, start: float, end: float) -> RequestResult:
        if self.error:
            return RequestResult(False, error=self.error)
        if not self.arrivals:
            return RequestResult(False, error="the stream carried no output")
        if self.output_tokens is None:
            return RequestResult(False, error="the stream carried no usage (include_usage)")
        exact = len(self.cumulative) == len(self.arrivals)
        try:
            counts = chunk_token_counts(
                self.text_lengths, self.output_tokens, self.cumulative if exact else None
            )
        except ValueError as exc:
            return RequestResult(False, error=str(exc))
        return RequestResult(
            True,
            self.output_tokens,
            self.arrivals[0] - start,
            end - start,
            token_itls(self.arrivals, counts),
            num_chunks=len(self.arrivals),
        )


# --- the load --------------------------------------------------------------------------------------


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
    pool: ConnectionPool, body: dict[str, Any], timeout_s: float
) -> RequestResult:
    recorder = _StreamRecorder()
    start = time.perf_counter()
    try:
        await asyncio.wait_for(pool.post("/v1/completions", body, recorder.on_event), timeout_s)
    except HTTPStatusError as exc:
        return RequestResult(False, error=str(exc))
    except (TimeoutError, OSError, EOFError, ValueError, KeyError, TypeError) as exc:
        # EOFError: the connection closed mid-response; ValueError: malformed JSON in an event
        # or broken HTTP framing; KeyError, TypeError: a chunk not shaped as OpenAI's.
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    return recorder.result(start, time.perf_counter())


@dataclass
class _Share:
    """One client process's part of the load: its requests, arrival offsets and slots."""

    base_url: str
    bodies: list[dict[str, Any]]
    arrivals: list[float]
    concurrency: int | None
    timeout_s: float


@dataclass
class _ShareResult:
    results: list[RequestResult]
    end: float
    cpu_s: float


async def _drive(share: _Share, start_at: float) -> _ShareResult:
    """Send the share's requests from `start_at` (a perf_counter time) on."""
    pool = ConnectionPool(Endpoint.from_url(share.base_url))
    gate = asyncio.Semaphore(share.concurrency or len(share.bodies))

    async def scheduled(i: int) -> RequestResult:
        delay = start_at + share.arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            return await one_request(pool, share.bodies[i], share.timeout_s)

    delay = start_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    # The event loop's thread does all the client's work; its CPU time is the client's cost.
    cpu_before = time.thread_time()
    try:
        results = await asyncio.gather(*(scheduled(i) for i in range(len(share.bodies))))
    finally:
        pool.close()
    return _ShareResult(list(results), time.perf_counter(), time.thread_time() - cpu_before)


def _worker_main(connection: Connection, share: _Share) -> None:
    """A client process: report ready, wait for the common start time, drive, send results."""
    connection.send("ready")
    start_at = connection.recv()
    connection.send(asyncio.run(_drive(share, start_at)))
    connection.close()


def _split(share: _Share, workers: int) -> list[_Share]:
    """Deal the requests round robin; each worker gets its part of the concurrency."""
    parts = []
    for w in range(workers):
        concurrency = None
        if share.concurrency is not None:
            concurrency = share.concurrency // workers + (w < share.concurrency % workers)
        parts.append(
            _Share(
                share.base_url,
                share.bodies[w::workers],
                share.arrivals[w::workers],
                concurrency,
                share.timeout_s,
            )
        )
    return parts


def _drive_in_processes(share: _Share, workers: int) -> tuple[list[_ShareResult], float]:
    """Run the shares in `workers` spawned processes started together; results and start."""
    context = multiprocessing.get_context("spawn")
    links = []
    processes = []
    for part in _split(share, workers):
        parent, child = context.Pipe()
        process = context.Process(target=_worker_main, args=(child, part), daemon=True)
        process.start()
        child.close()
        links.append(parent)
        processes.append(process)
    try:
        for link in links:
            link.recv()
        # perf_counter is the system's monotonic clock, the same in every process.
        start_at = time.perf_counter() + 0.05
        for link in links:
            link.send(start_at)
        return [link.recv() for link in links], start_at
    except EOFError:
        codes = [p.exitcode for p in processes]
        raise RuntimeError(f"a client worker process exited early (exit codes {codes})") from None
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()


async def _prepare(args: argparse.Namespace) -> tuple[str | None, dict[str, Any], _Share]:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=30.0) as http:
        served, engine_info = await discover(http)
    model = args.model or served
    vocab = args.vocab_size or int(engine_info.get("vocab_size") or 32000)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    stream_options: dict[str, bool] = {"include_usage": True}
    if args.continuous_usage_stats:
        stream_options["continuous_usage_stats"] = True
    bodies = [
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": args.output_len,
            "temperature": args.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": stream_options,
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
    share = _Share(args.base_url, bodies, arrivals, args.concurrency, args.timeout)
    return model, engine_info, share


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Discover the model, drive the load (in this process or `--workers`), build the report."""
    model, engine_info, share = asyncio.run(_prepare(args))
    if args.workers == 1:
        start_at = time.perf_counter()
        shares = [asyncio.run(_drive(share, start_at))]
    else:
        shares, start_at = _drive_in_processes(share, args.workers)
    duration = max(s.end for s in shares) - start_at
    results = [r for s in shares for r in s.results]

    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    num_chunks = sum(r.num_chunks for r in ok)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    client_cpu_s = sum(s.cpu_s for s in shares)
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
                "reader": "davit_engine.bench.sse_client",
                "workers": args.workers,
                "continuous_usage_stats": args.continuous_usage_stats,
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
            "itl_definition": ITL_DEFINITION,
            "e2e_s": summarize([r.e2e_s for r in ok]),
            "chunks": num_chunks,
            "tokens_per_chunk": output_tokens / num_chunks if num_chunks else math.nan,
            "client_cpu_s": client_cpu_s,
            "client_cpu_util": client_cpu_s / duration,
            "client_cpu_util_max": max(s.cpu_s for s in shares) / duration,
            "client_cpu_us_per_token": (
                client_cpu_s / output_tokens * 1e6 if output_tokens else math.nan
            ),
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
    client = c["client"]
    counts = "usage in every chunk" if client["continuous_usage_stats"] else "text length"
    print(
        f"client: {client['workers']} process(es), lean SSE reader; per-chunk token counts "
        f"from {counts}"
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
    print(f"ITL is {r['itl_definition']}; {r['tokens_per_chunk']:.2f} tokens per chunk")
    print(
        f"client CPU {r['client_cpu_s']:.2f} s ({r['client_cpu_util']:.0%} of one core over the "
        f"run), {r['client_cpu_us_per_token']:.1f} us per output token"
    )
    if r["client_cpu_util_max"] > SATURATED_UTIL:
        print(
            f"warning: a client process was busy {r['client_cpu_util_max']:.0%} of the run; "
            "it may have limited the load and delayed the arrival times (try --workers)"
        )


def serve_bench_main(rest: list[str]) -> int:
    """Entry point of `davit bench serve`; 1 when no request succeeded, else 0."""
    parser = build_parser()
    args = parser.parse_args(rest)
    check_args(parser, args)
    try:
        report = run(args)
    except httpx.HTTPError as exc:
        print(f"davit bench serve: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 1
    _print_report(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2, allow_nan=True)
    return 0 if report["results"]["completed"] else 1
