"""`python -m davit_tools.bench.api_stream`: how many streamed tokens/s the API process delivers.

It measures the HTTP front end alone. The real app runs (FastAPI, uvicorn, the engine client,
the engine-core process and the pipe between them), but the core is `StreamCore`: it emits
`--tokens-per-step` tokens per step for every running request, with no model behind it, either
as fast as it can (`--step-ms 0`) or once every `--step-ms` milliseconds. `--concurrency`
streaming clients (httpx, over loopback) keep that many requests in flight until
`--num-requests` have finished, and count the tokens delivered per second and the gaps between
consecutive events of one stream (ITL).

The server runs in a child process. Once it is ready, the API process's threads are pinned to
`--api-cpu` and the core process and the clients to the other CPUs, so the figure is what one
CPU core of API process sustains. The CPU seconds the API process spent are read from /proc and
reported per token: the cost of the API path, independent of what limited the run.

With `--base-url` the same clients measure a server that is already running (a real engine,
`davit serve`); tokens are then counted from each stream's usage, and `--api-pid` names the
API process whose CPU use to report.

The clients read the SSE responses with the lean reader of `bench.sse_client` by default
(`--client raw`): httpx costs tens of microseconds per received event, so one client process
could not read as fast as the server writes one event per token; `--client httpx` is there to
compare.

Prints its configuration, then one JSON line with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import davit_engine
from davit_engine.bench.sse_client import (
    Endpoint,
    HTTPStatusError,
    SSEConnection,
    parse_completion_chunk,
)
from davit_engine.config import EngineConfig
from davit_engine.types import (
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestDelta,
    TokenLogprob,
)

# Read by StreamCore in the core process (inherited through the environment).
TOKENS_PER_STEP_ENV = "DAVIT_BENCH_TOKENS_PER_STEP"
STEP_S_ENV = "DAVIT_BENCH_STEP_S"

# Every generated token is one printable ASCII byte, so a client counts tokens as characters.
SCRIPT = b"Streaming tokens through the API process, one step at a time. "
VOCAB_SIZE = 512
EOS_TOKEN_ID = 257
MAX_MODEL_LEN = 1 << 20
MODEL = "api-stream-bench"
# The module's import name even when it runs as `__main__` (the core process imports it).
MODULE = "davit_tools.bench.api_stream"


# --- the stand-in engine core (runs in the core process) ---------------------------------------


@dataclass(frozen=True)
class StreamModelInfo:
    served_model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str = "none"
    device: str = "cpu"
    runner: str = "api-stream-bench"
    runner_reason: str = "measures the API process; no model runs"


@dataclass
class _Running:
    request: EngineRequest
    num_output_tokens: int = 0


class StreamCore:
    """An engine core without a model: every step gives each running request N more tokens.

    Implements the surface `ipc.core_process.CoreLoop` drives. Output token i of a request is
    byte (i + seed) of `SCRIPT` (seed 0 when unset), so choices with different seeds differ.
    Requests finish with `length` after `max_tokens`; with `logprobs` set, every token carries
    logprob -0.5 and the alternatives (token, -0.5), (token + 1, -1.5).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.tokens_per_step = int(os.environ.get(TOKENS_PER_STEP_ENV, "1"))
        self.step_s = float(os.environ.get(STEP_S_ENV, "0"))
        self.model_info = StreamModelInfo(
            served_model_name=config.model_name,
            max_model_len=config.max_model_len or MAX_MODEL_LEN,
            vocab_size=VOCAB_SIZE,
            eos_token_ids=(EOS_TOKEN_ID,),
        )
        self._running: dict[str, _Running] = {}
        self._next_step_at: float | None = None

    def add_request(self, request: EngineRequest) -> None:
        self._running[request.request_id] = _Running(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._running.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        if not self._running:
            self._next_step_at = None
        return bool(self._running)

    def step(self) -> list[RequestDelta]:
        if self.step_s > 0:
            # Steps start on a fixed schedule, so the offered rate is exactly one step per
            # `step_s` whatever this loop costs; after idling, the schedule starts again.
            now = time.monotonic()
            if self._next_step_at is None or now - self._next_step_at > self.step_s:
                self._next_step_at = now
            time.sleep(max(0.0, self._next_step_at - now))
            self._next_step_at += self.step_s
        deltas = []
        finished = []
        for request_id, running in self._running.items():
            sampling = running.request.sampling
            start = running.num_output_tokens + (sampling.seed or 0)
            count = min(self.tokens_per_step, sampling.max_tokens - running.num_output_tokens)
            ids = [SCRIPT[(start + i) % len(SCRIPT)] for i in range(count)]
            running.num_output_tokens += count
            done = running.num_output_tokens >= sampling.max_tokens
            logprobs = None
            if sampling.logprobs is not None:
                logprobs = [
                    TokenLogprob(t, -0.5, [(t, -0.5), (t + 1, -1.5)][: sampling.logprobs])
                    for t in ids
                ]
            deltas.append(
                RequestDelta(
                    request_id,
                    ids,
                    logprobs,
                    FinishReason.LENGTH if done else None,
                    num_prompt_tokens=len(running.request.prompt_token_ids),
                )
            )
            if done:
                finished.append(request_id)
        for request_id in finished:
            del self._running[request_id]
        return deltas

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._running))

    def shutdown(self) -> None:
        """Nothing to release."""


# --- the server (child process) ----------------------------------------------------------------


def _byte_tokenizer(_: EngineConfig) -> Any:
    from davit_engine.tokenizer import ByteTokenizer

    return ByteTokenizer(VOCAB_SIZE, None, (EOS_TOKEN_ID,))


def _serve(port: int, profile_path: str | None) -> None:
    import cProfile

    import uvicorn

    from davit_engine.server.app import create_app

    config = EngineConfig(model=MODEL)
    app = create_app(
        config,
        core_factory=f"{MODULE}:StreamCore",
        tokenizer_loader=_byte_tokenizer,
    )
    # uvicorn re-raises the SIGTERM that stopped it once it has shut down; a Python handler
    # keeps that from killing the process before the profile is written.
    signal.signal(signal.SIGTERM, lambda *_: None)
    profiler = cProfile.Profile() if profile_path else None
    if profiler is not None:
        profiler.enable()
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(profile_path))


# --- CPU placement and accounting --------------------------------------------------------------


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for tid in _threads(pid):
        text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        found.extend(int(c) for c in text.split())
    return found


def _pin(pid: int, cpus: set[int]) -> None:
    for tid in _threads(pid):
        os.sched_setaffinity(tid, cpus)


def _core_process(server_pid: int) -> int | None:
    """The engine-core process: the server's child started by multiprocessing's spawn."""
    for pid in _children(server_pid):
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    return None


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of the whole process (all threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the clients (this process) ----------------------------------------------------------------


@dataclass
class StreamResult:
    ok: bool
    tokens: int = 0
    events: int = 0
    usage_tokens: int = 0
    ttft_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    error: str = ""


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _body(args: argparse.Namespace, i: int) -> tuple[str, dict[str, Any]]:
    rng = random.Random(i)
    common: dict[str, Any] = {
        "max_tokens": args.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if args.base_url is None:
        common["model"] = MODEL  # another server answers for its own model when none is named
    if args.endpoint == "chat":
        content = "".join(chr(rng.randrange(97, 123)) for _ in range(args.input_len))
        body = {**common, "messages": [{"role": "user", "content": content}]}
        if args.logprobs is not None:
            body |= {"logprobs": True, "top_logprobs": args.logprobs}
        return "/v1/chat/completions", body
    body = {**common, "prompt": [rng.randrange(32, 127) for _ in range(args.input_len)]}
    if args.logprobs is not None:
        body["logprobs"] = args.logprobs
    return "/v1/completions", body


class _StreamCounter:
    """Counts one stream's tokens and the gaps between its events, fed one SSE event's data each.

    Against `StreamCore` every token is one character, so the text itself is counted and
    checked against the usage; against another server only the usage counts tokens.
    """

    def __init__(self, expected_tokens: int, chars_are_tokens: bool) -> None:
        self.expected_tokens = expected_tokens
        self.chars_are_tokens = chars_are_tokens
        self.num_chars = 0
        self.start = time.perf_counter()
        self.last: float | None = None
        self.result = StreamResult(ok=False)

    def feed(self, data: bytes, arrived: float) -> bool:
        """Take one event's data and when it arrived; False once the stream carried an error."""
        chunk = parse_completion_chunk(data)
        if chunk is None:
            return True
        if chunk.error is not None:
            self.result.error = chunk.error
            return False
        if chunk.completion_tokens is not None:
            self.result.usage_tokens = chunk.completion_tokens
        text = chunk.text
        if not text:
            return True
        if self.last is None:
            self.result.ttft_s = arrived - self.start
        else:
            self.result.itls_s.append(arrived - self.last)
        self.last = arrived
        self.num_chars += len(text)
        self.result.events += 1
        return True

    def finish(self) -> StreamResult:
        result = self.result
        if result.error:
            return result
        result.tokens = self.num_chars if self.chars_are_tokens else result.usage_tokens
        result.ok = result.tokens == result.usage_tokens == self.expected_tokens
        if not result.ok:
            result.error = (
                f"expected {self.expected_tokens} tokens, streamed {result.tokens}, "
                f"usage says {result.usage_tokens}"
            )
        return result


async def _httpx_stream(
    http: Any, path: str, body: dict[str, Any], chars_are_tokens: bool
) -> StreamResult:
    counter = _StreamCounter(body["max_tokens"], chars_are_tokens)
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:300]
            counter.result.error = f"HTTP {response.status_code}: {detail}"
            return counter.result
        async for line in response.aiter_lines():
            if line.startswith("data: ") and not counter.feed(
                line[6:].encode(), time.perf_counter()
            ):
                break
    return counter.finish()


async def _raw_stream(
    connection: SSEConnection, path: str, body: dict[str, Any], chars_are_tokens: bool
) -> StreamResult:
    counter = _StreamCounter(body["max_tokens"], chars_are_tokens)
    try:
        await connection.post(path, body, counter.feed)
    except HTTPStatusError as exc:
        counter.result.error = str(exc)
        return counter.result
    return counter.finish()


async def _run_clients(args: argparse.Namespace, base_url: str) -> tuple[list[StreamResult], float]:
    """`--concurrency` workers, each with its own connection, take requests until none is left.

    One connection per worker: httpx's shared connection pool scans all its connections on
    every request, which costs the benchmark more CPU than the streams themselves.
    """
    import httpx

    bodies = [_body(args, i) for i in range(args.num_requests)]
    chars_are_tokens = args.base_url is None
    results: list[StreamResult] = []
    next_index = iter(range(args.num_requests))
    endpoint = Endpoint.from_url(base_url)

    async def httpx_worker() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout) as http:
            for i in next_index:
                try:
                    results.append(await _httpx_stream(http, *bodies[i], chars_are_tokens))
                except httpx.HTTPError as exc:
                    results.append(StreamResult(False, error=f"{type(exc).__name__}: {exc}"))

    async def raw_worker() -> None:
        connection = SSEConnection(endpoint)
        try:
            for i in next_index:
                try:
                    stream = _raw_stream(connection, *bodies[i], chars_are_tokens)
                    results.append(await asyncio.wait_for(stream, args.timeout))
                except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError) as exc:
                    results.append(StreamResult(False, error=f"{type(exc).__name__}: {exc}"))
                    connection.close()  # its state is unknown: the next request reconnects
        finally:
            connection.close()

    worker = raw_worker if args.client == "raw" else httpx_worker
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return results, time.perf_counter() - started


def _wait_ready(base_url: str, server: subprocess.Popen[bytes], timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the bench server exited with status {server.returncode}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the bench server at {base_url} was not ready in {timeout_s:.0f} s")


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Start and pin the server (unless `--base-url`), run the clients; the report as a dict."""
    cpus = sorted(os.sched_getaffinity(0))
    if args.base_url is not None:
        api_pid = args.api_pid
        placement = f"external server {args.base_url}" + (
            f" (API process {api_pid})" if api_pid else ""
        )
        return _report(args, cpus, placement, *_measure(args, args.base_url, api_pid, None))
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        TOKENS_PER_STEP_ENV: str(args.tokens_per_step),
        STEP_S_ENV: str(args.step_ms / 1e3),
    }
    command = [sys.executable, "-m", MODULE, "--serve-port", str(port)]
    if args.api_profile:
        command += ["--api-profile", args.api_profile]
    server = subprocess.Popen(command, env=env)
    try:
        _wait_ready(base_url, server, args.startup_timeout)
        core = _core_process(server.pid)
        if core is None:
            raise RuntimeError("the bench server has no engine-core process")
        if not args.pin:
            placement = "not pinned (--no-pin)"
        elif len(cpus) == 1:
            placement = "not pinned (one CPU available)"
        else:
            others = set(cpus) - {args.api_cpu}
            _pin(server.pid, {args.api_cpu})
            for child in _children(server.pid):
                _pin(child, others)
            os.sched_setaffinity(0, others)
            placement = f"API process on CPU {args.api_cpu}; core and clients on {sorted(others)}"
        measured = _measure(args, base_url, server.pid, core)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    return _report(args, cpus, placement, *measured)


def _measure(
    args: argparse.Namespace, base_url: str, api_pid: int | None, core_pid: int | None
) -> tuple[list[StreamResult], float, dict[str, float | None]]:
    """Run the clients; their results, the duration and the CPU seconds each process used."""
    pids = {"api": api_pid, "core": core_pid, "client": os.getpid()}
    before = {name: _cpu_seconds(pid) for name, pid in pids.items() if pid is not None}
    results, duration = asyncio.run(_run_clients(args, base_url))
    cpu_s: dict[str, float | None] = {
        name: None if pid is None else _cpu_seconds(pid) - before[name]
        for name, pid in pids.items()
    }
    return results, duration, cpu_s


def _report(
    args: argparse.Namespace,
    cpus: list[int],
    placement: str,
    results: list[StreamResult],
    duration: float,
    cpu_s: dict[str, float | None],
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    events = sum(r.events for r in ok)
    itls = [x for r in ok for x in r.itls_s]
    errors = sorted({r.error for r in results if not r.ok})

    def util(name: str) -> float | None:
        seconds = cpu_s[name]
        return None if seconds is None else round(seconds / duration, 3)

    api_cpu_s = cpu_s["api"]
    return {
        "config": {
            "endpoint": args.endpoint,
            "client": args.client,
            "concurrency": args.concurrency,
            "num_requests": args.num_requests,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "tokens_per_step": None if args.base_url else args.tokens_per_step,
            "step_ms": None if args.base_url else args.step_ms,
            "logprobs": args.logprobs,
            "placement": placement,
            "davit": davit_engine.__version__,
            "python": platform.python_version(),
            "host": platform.node(),
            "cpus": len(cpus),
        },
        "results": {
            "completed": len(ok),
            "errors": len(results) - len(ok),
            "error_examples": errors[:3],
            "duration_s": round(duration, 4),
            "tokens": tokens,
            "tokens_per_s": round(tokens / duration, 1),
            "events_per_s": round(events / duration, 1),
            "tokens_per_event": round(tokens / events, 3) if events else None,
            "api_cpu_s": None if api_cpu_s is None else round(api_cpu_s, 3),
            "api_cpu_util": util("api"),
            "api_cpu_us_per_token": (
                round(api_cpu_s / tokens * 1e6, 2) if api_cpu_s is not None and tokens else None
            ),
            "core_cpu_util": util("core"),
            "client_cpu_util": util("client"),
            "ttft_ms_p50": _ms(_percentile([r.ttft_s for r in ok], 50)),
            "itl_ms_p50": _ms(_percentile(itls, 50)),
            "itl_ms_p99": _ms(_percentile(itls, 99)),
        },
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m davit_tools.bench.api_stream", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--concurrency", type=int, default=64, help="streams kept in flight")
    p.add_argument("--num-requests", type=int, default=256, help="requests in all")
    p.add_argument(
        "--input-len",
        type=int,
        default=1024,
        help="prompt tokens per request (chat: characters of the user message)",
    )
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--tokens-per-step", type=int, default=1, help="tokens per request per step")
    p.add_argument(
        "--step-ms", type=float, default=0.0, help="time one core step takes (0: no wait)"
    )
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="raw: a minimal HTTP/1.1 reader (cheap per event); httpx: the httpx client",
    )
    p.add_argument("--logprobs", type=int, default=None, help="top logprobs per token (off)")
    p.add_argument(
        "--base-url",
        default=None,
        help="measure this running server instead of starting one (tokens counted from usage)",
    )
    p.add_argument(
        "--api-pid",
        type=int,
        default=None,
        help="with --base-url: the server's API process, to report its CPU use",
    )
    p.add_argument("--api-cpu", type=int, default=0, help="the CPU the API process runs on")
    p.add_argument(
        "--no-pin", dest="pin", action="store_false", help="leave processes where they are"
    )
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    p.add_argument("--startup-timeout", type=float, default=60.0, help="server start, seconds")
    p.add_argument(
        "--api-profile",
        default=None,
        help="write a cProfile of the API process's event loop thread to this file",
    )
    p.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("concurrency", "num_requests", "input_len", "output_len", "tokens_per_step"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be at least 1")
    if args.step_ms < 0:
        parser.error("argument --step-ms: must not be negative")
    if args.logprobs is not None and not 0 <= args.logprobs <= 2:
        parser.error("argument --logprobs: must be in [0, 2]")
    if args.api_pid is not None and args.base_url is None:
        parser.error("argument --api-pid: only with --base-url (else the bench starts the server)")
    if args.api_pid is not None and not Path(f"/proc/{args.api_pid}").exists():
        parser.error(f"argument --api-pid: no process {args.api_pid}")
    if args.base_url is not None and not args.base_url.startswith("http://"):
        parser.error("argument --base-url: must start with http://")
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) > 1 and args.api_cpu not in cpus:
        parser.error(f"argument --api-cpu: must be one of the CPUs this may run on, {cpus}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.serve_port is not None:
        _serve(args.serve_port, args.api_profile)
        return 0
    check_args(parser, args)
    report = run_bench(args)
    c = report["config"]
    core = (
        "the server's own engine"
        if args.base_url
        else f"{c['tokens_per_step']} token(s) per step every {c['step_ms']:g} ms"
    )
    print(
        f"api_stream: {c['endpoint']}, {c['concurrency']} streams, {c['num_requests']} requests, "
        f"{c['input_len']} in / {c['output_len']} out, {core}, logprobs {c['logprobs']}; "
        f"{c['placement']}; davit {c['davit']}, Python {c['python']}, {c['cpus']} CPUs"
    )
    print(json.dumps(report))
    return 0 if report["results"]["completed"] == args.num_requests else 1


if __name__ == "__main__":
    sys.exit(main())
