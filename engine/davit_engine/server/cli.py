"""`davit serve MODEL [flags]`: parse upstream-named flags, build the app, run uvicorn.

Exit status: 0 after a normal shutdown or a completed drain, 1 when the model fails to load,
2 for bad flags (argparse's convention; the message names the flag).

SIGTERM drains: `/ready` turns 503, new requests get 503, in-flight requests finish (bounded by
`--drain-timeout`; past it, open streams end with an error event), then the server exits 0. A
second SIGTERM, or SIGINT, stops at once.

The API key comes from `--api-key` or, where the flag is absent, the `VLLM_API_KEY` environment
variable (how the operator passes it from a Secret, so it never shows in the pod's arguments).
It is never printed: `--help` names the variable, not its value.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

import uvicorn

from davit_contract import engine_defaults
from davit_engine.config import (
    FP8_BLOCK_SCALES,
    KV_CACHE_DTYPES,
    LM_HEAD_QUANTIZATIONS,
    QUANTIZATIONS,
    EngineConfig,
)
from davit_engine.engine_flags import (
    check_compilation_config,
    check_parallelism,
    check_speculative_config,
)
from davit_engine.loader.hf_cache import repo_id_of, resolve_snapshot
from davit_engine.server.app import create_app
from davit_engine.server.auth import API_KEY_ENV
from davit_engine.server.connections import uvicorn_config
from davit_engine.server.profile_only import default_output, profile_only
from davit_engine.server.state import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerSettings, ServerState
from davit_engine.types import ParamError

logger = logging.getLogger("davit.serve")


def _int_at_least(minimum: int) -> type[int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse  # type: ignore[return-value]  # argparse only needs a callable


def _port(text: str) -> int:
    value = _int_at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be at most 65535, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="davit serve",
        description="Serve MODEL over an OpenAI-compatible HTTP API.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model", help="a .gguf file, a Hugging Face directory, or random:<shape>")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind")
    server.add_argument("--port", type=_port, default=8000)
    server.add_argument("--served-model-name", default=None, help="model name clients use")
    server.add_argument(
        "--drain-timeout",
        type=_non_negative_float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    server.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    server.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health, /ready and "
        f"/metrics (default: the {API_KEY_ENV} environment variable; unset: no key)",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=_int_at_least(1),
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies are refused with HTTP 413 (the default fits a 1M-token "
        "prompt as text or as token ids)",
    )
    server.add_argument(
        "--request-read-timeout",
        type=_positive_float,
        default=60.0,
        help="seconds a client gets to send a request's headers, and again its body; slower "
        "clients are disconnected (a late body is answered HTTP 408)",
    )
    server.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="parse special-token text in chat message content as control tokens (by default "
        "it is plain text, so a client cannot forge a turn of another role)",
    )
    engine = p.add_argument_group("engine")
    engine.add_argument("--tokenizer", default=None, help="tokenizer source (default: the model)")
    engine.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    engine.add_argument(
        "-q",
        "--quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help="fp8: FP8 projection weights (checkpoints in bf16/fp16 are quantized at load; "
        "FP8 checkpoints are detected without it)",
    )
    engine.add_argument(
        "--lm-head-quantization",
        default=None,
        choices=list(LM_HEAD_QUANTIZATIONS),
        help="the LM head's weight in one byte, one scale per row: fp8 (e4m3; FP8 hardware) or "
        "int8 (any device, about four times fp8's precision). Lossy beyond --quantization fp8, "
        "which keeps the LM head in the model dtype: faster decode at small batch, logits "
        "rounded differently",
    )
    engine.add_argument(
        "--fp8-block-scales",
        default="channel",
        choices=list(FP8_BLOCK_SCALES),
        help="block-wise FP8 checkpoints (a scale per block of each weight): channel "
        "re-quantizes them to one scale per output channel at load (the per-channel FP8 "
        "products; some values rounded to e4m3 a second time), native multiplies with their "
        "own block scales (their values exactly)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="KV cache element type: auto (the model dtype) or fp8 (e4m3, per-layer scales)",
    )
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--max-model-len", type=_int_at_least(1), default=None)
    engine.add_argument(
        "--block-size",
        type=int,
        default=engine_defaults.BLOCK_SIZE,
        choices=list(engine_defaults.BLOCK_SIZES),
    )
    engine.add_argument(
        "--max-num-seqs", type=_int_at_least(1), default=engine_defaults.MAX_NUM_SEQS
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=_int_at_least(1),
        default=engine_defaults.MAX_NUM_BATCHED_TOKENS,
    )
    engine.add_argument(
        "--max-queue-len",
        type=_int_at_least(0),
        default=None,
        help="requests allowed to wait beyond free running slots; more get HTTP 429",
    )
    engine.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    engine.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    engine.add_argument("--num-gpu-blocks-override", type=_int_at_least(1), default=None)
    engine.add_argument("--kv-cache-memory-bytes", type=_int_at_least(1), default=None)
    engine.add_argument(
        "--gpu-memory-utilization", type=float, default=engine_defaults.GPU_MEMORY_UTILIZATION
    )
    engine.add_argument("--runner", default="auto", choices=["auto", "v1", "v2"])
    engine.add_argument("--enforce-eager", action="store_true")
    engine.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule step N+1 while the device runs step N (runner V2; V1 stays synchronous)",
    )
    engine.add_argument("--max-logprobs", type=_int_at_least(0), default=20)
    engine.add_argument(
        "--revision",
        default=None,
        help="model revision: selects the snapshot of an hf://ORG/NAME (or ORG/NAME) model in "
        "the local Hugging Face cache; recorded only for a local directory",
    )
    engine.add_argument(
        "--logits-processors",
        nargs="+",
        default=[],
        metavar="MODULE.CLASS",
        help="custom logits processors applied to every request (needs runner V1)",
    )
    offload = p.add_argument_group(
        "KV offload",
        "tiers below the GPU prefix cache: host memory, then disk (docs/kv-offload.md)",
    )
    offload.add_argument(
        "--kv-offloading-size",
        type=_positive_float,
        default=None,
        metavar="GIB",
        help="CPU tier: GiB of host memory for KV blocks (upstream's flag and unit)",
    )
    offload.add_argument(
        "--kv-offloading-backend",
        default="native",
        help="native (upstream's lmcache is not available)",
    )
    offload.add_argument(
        "--kv-offload-disk-path",
        default=None,
        metavar="DIR",
        help="disk tier: folder of KV block files (kept across restarts)",
    )
    offload.add_argument(
        "--kv-offload-disk-bytes",
        type=_int_at_least(1),
        default=None,
        help="disk tier: bytes of block files at most",
    )
    upstream = p.add_argument_group(
        "upstream flags", "accepted so the operator can drive either engine; see engine_flags"
    )
    upstream.add_argument("--tensor-parallel-size", type=int, default=1)
    upstream.add_argument("--pipeline-parallel-size", type=int, default=1)
    upstream.add_argument("--data-parallel-size", type=int, default=1)
    upstream.add_argument("--enable-expert-parallel", action="store_true")
    upstream.add_argument("--enable-elastic-ep", action="store_true")
    upstream.add_argument("--enable-dbo", action="store_true")
    upstream.add_argument("--compilation-config", default=None, metavar="JSON")
    upstream.add_argument("--speculative-config", default=None, metavar="JSON")
    memory = p.add_argument_group("memory profile")
    memory.add_argument(
        "--profile-only",
        action="store_true",
        help="measure memory, print the profile as JSON and exit without serving",
    )
    memory.add_argument(
        "--profile-output",
        default=None,
        help="file for the --profile-only JSON (default: /dev/termination-log when writable)",
    )
    return p


def parse_args(rest: list[str]) -> tuple[EngineConfig, ServerSettings, str]:
    """Flags to (engine config, server settings, log level); bad flags exit 2 via argparse."""
    config, settings, log_level, _ = _parse(rest)
    return config, settings, log_level


def _parse(rest: list[str]) -> tuple[EngineConfig, ServerSettings, str, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(rest)
    config = EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        quantization=args.quantization,
        lm_head_quantization=args.lm_head_quantization,
        fp8_block_scales=args.fp8_block_scales,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        seed=args.seed,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queue_len=args.max_queue_len,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        num_gpu_blocks=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        runner=args.runner,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        max_logprobs=args.max_logprobs,
        revision=args.revision,
        logits_processors=tuple(args.logits_processors),
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
        kv_offload_disk_path=args.kv_offload_disk_path,
        kv_offload_disk_bytes=args.kv_offload_disk_bytes,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    try:
        config.validate()
        check_parallelism(
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            args.data_parallel_size,
            args.enable_expert_parallel,
            args.enable_elastic_ep,
            args.enable_dbo,
        )
        check_compilation_config(args.compilation_config)
        speculative = check_speculative_config(args.speculative_config)
        if speculative is not None:
            draft_repo = repo_id_of(speculative.model) if speculative.model else None
            if draft_repo is not None:  # a draft model loads from the cache like the model
                try:
                    draft = resolve_snapshot(draft_repo, None)
                except ParamError as exc:
                    raise ParamError("--speculative-config", f"model: {exc.message}") from None
                speculative = dataclasses.replace(speculative, model=str(draft))
            config = dataclasses.replace(config, speculative_config=speculative)
        repo_id = repo_id_of(config.model)
        if repo_id is not None:
            snapshot = resolve_snapshot(repo_id, config.revision)
            config = dataclasses.replace(
                config, model=str(snapshot), served_model_name=config.served_model_name or repo_id
            )
    except ParamError as exc:
        parser.error(f"argument {exc.param}: {exc.message}")
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        drain_timeout_s=args.drain_timeout,
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
        max_request_body_bytes=args.max_request_body_bytes,
        request_read_timeout_s=args.request_read_timeout,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
    )
    return config, settings, args.log_level, args


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM turned into a drain instead of an immediate shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)  # type: ignore[arg-type]

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.state.draining and self._loop is not None:
            # Not recorded in uvicorn's captured signals: uvicorn would re-raise it at exit and
            # the process would die by SIGTERM instead of exiting 0 after the drain.
            self.state.begin_drain()
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        if sig == signal.SIGTERM:
            self.should_exit = True  # second SIGTERM (or before startup): stop now
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        logger.info("SIGTERM: draining for up to %.0f s", self.state.settings.drain_timeout_s)
        drained = await self.state.drain(self.state.settings.drain_timeout_s)
        logger.info(
            "drain %s; shutting down",
            "complete" if drained else "timed out (open requests were ended)",
        )
        self.should_exit = True


def serve_main(rest: list[str]) -> int:
    """Entry point of `davit serve`; returns the process exit status."""
    config, settings, log_level, args = _parse(rest)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.profile_only:
        output = Path(args.profile_output) if args.profile_output else default_output()
        return profile_only(config, output)
    exit_code = 0
    server: DrainingServer | None = None

    def on_fatal(reason: str) -> None:
        nonlocal exit_code
        exit_code = 1
        logger.error("cannot serve %s: %s", config.model, reason)
        if server is not None:
            server.should_exit = True

    app = create_app(config, settings, on_fatal=on_fatal)
    server = DrainingServer(uvicorn_config(app, settings, log_level), app.state.davit)
    server.run()
    return exit_code


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
