"""The engine core: scheduler + runner, one `step()` at a time. Tokens in, token deltas out.

It knows nothing about text: the front end tokenizes, detokenizes and matches stop strings.
`step()` only wires schedule → execute → update, as the loop of the engine-core process.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from davit_contract.profile import MemoryProfile
from davit_engine.config import EngineConfig
from davit_engine.core.scheduler import Scheduler
from davit_engine.engine_flags import load_logits_processors
from davit_engine.isolating_runner import isolating
from davit_engine.loader import (
    check_tensor_parallel,
    load_model,
    read_model_config,
)
from davit_engine.memory.allocator import configure_cuda_allocator
from davit_engine.offload import PROFILE_OFFLOAD_KEYS, build_tiers, staging_chunk
from davit_engine.offload.mover import staging_blocks
from davit_engine.offload.runner import OffloadingRunner
from davit_engine.rank_workers import ParallelRunner, RankGroup
from davit_engine.runner.base import ModelRunner
from davit_engine.runner.capability import check_request
from davit_engine.runner.select import create_runner, resolve_device, select_runner
from davit_engine.runner.v1 import RunnerV1
from davit_engine.step_pipeline import StepPipeline
from davit_engine.types import (
    EngineRequest,
    EngineStats,
    FinishReason,
    ParamError,
    RequestDelta,
)

logger = logging.getLogger(__name__)

# How long an engine step with nothing but offload loads pending waits for them.
_IDLE_LOAD_WAIT_S = 0.005


@dataclass(frozen=True)
class ModelInfo:
    """What the front end needs to know about the served model (plain data, picklable)."""

    served_model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    runner: str
    runner_reason: str
    architecture: str
    num_parameters: int
    # The startup memory profile (davit_engine.memory.MemoryProfile.to_dict()), when measured.
    memory_profile: dict[str, Any] | None = None
    # Whether the CPU schedules step N+1 while the device runs step N (runner V2 only).
    async_scheduling: bool = False
    # --revision as given (informational for a local directory or a random shape).
    revision: str | None = None
    # --speculative-config as run (SpeculativeConfig.to_info(): method, K, verification and
    # whether it is lossy), None without speculative decoding.
    speculative: dict[str, Any] | None = None
    # The KV offload tiers (davit_engine.offload.offload_info), None without them.
    kv_offload: dict[str, Any] | None = None
    # Ranks the model is split over (--tensor-parallel-size).
    tensor_parallel_size: int = 1


class EngineCore:
    """Loads the model, builds the runner and its KV cache, and runs the scheduler loop.

    Raises ParamError at construction for a configuration that cannot work (naming the flag or
    file). `add_request` raises ParamError for invalid requests and QueueFullError when the
    waiting queue is full; an accepted request always ends with exactly one finished delta
    (STOP/LENGTH from `step()`, ABORT from the `step()` after `abort_requests`, or ERROR from
    the `step()` in which it failed alone: see isolating_runner). `step()` raises when the
    core cannot go on: a failure no request is to blame for (`RunnerFailure`, `DeviceFailure`
    for a device that runs no more work, a step where every request fails).
    """

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        # Registered before runner selection: custom logits processors need runner V1.
        load_logits_processors(config.logits_processors)
        self.config = config
        device = resolve_device(config)
        if device.type == "cuda":
            logger.info("CUDA allocator: %s", configure_cuda_allocator())
        kind, reason = select_runner(config, device)
        self.ranks: RankGroup | None = None
        if config.tensor_parallel_size > 1:
            # Refused here, before any worker process starts.
            check_tensor_parallel(config, read_model_config(config.model))
            self.ranks = RankGroup(config, device)
        try:
            self._start(config, device, kind, reason)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise

    def _start(self, config: EngineConfig, device: torch.device, kind: str, reason: str) -> None:
        ranks = self.ranks
        loaded = load_model(config, device, ranks.tp if ranks is not None else None)
        self.runner: ModelRunner = create_runner(kind, config, loaded, device)
        if ranks is not None:
            assert isinstance(self.runner, RunnerV1), "tensor parallelism runs on runner V1"
            self.runner = ParallelRunner(self.runner, ranks)
        num_blocks = self.runner.determine_num_blocks()
        self.memory_profile: MemoryProfile | None = getattr(self.runner, "memory_profile", None)
        # The offload tiers' GPU staging buffers come out of the KV cache's bytes.
        chunk = staging_chunk(config, device, num_blocks)
        if device.type == "cuda" and chunk:
            num_blocks -= staging_blocks(chunk)
            if num_blocks < 1:
                raise ParamError(
                    "--kv-offloading-size",
                    "the KV cache is too small to give the offload tiers their staging buffers",
                )
        capacity = num_blocks * config.block_size
        model_max = loaded.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ParamError(
                "--max-model-len",
                f"{config.max_model_len} exceeds the model's {model_max} positions",
            )
        max_model_len = min(config.max_model_len or model_max, capacity)
        if config.max_model_len is None:
            logger.info(
                "max_model_len=%d (model positions %d, KV capacity %d tokens)",
                max_model_len,
                model_max,
                capacity,
            )
        self.runner.initialize_kv_cache(num_blocks)
        self.tiers = build_tiers(config, self.runner, max_model_len, chunk)
        if self.tiers is not None and self.memory_profile is not None:
            info = self.tiers.info
            self.memory_profile = dataclasses.replace(
                self.memory_profile,
                offload={k: int(info[k]) for k in PROFILE_OFFLOAD_KEYS},
            )
        self.scheduler = Scheduler(config, num_blocks, max_model_len, tiers=self.tiers)
        async_scheduling = config.async_scheduling and self.runner.supports_async_scheduling
        if config.async_scheduling and not async_scheduling:
            logger.info("runner %s schedules synchronously (no asynchronous scheduling)", kind)
        self.isolation = isolating(self.runner, self.scheduler)
        stepping: ModelRunner = self.isolation
        if self.tiers is not None:
            stepping = OffloadingRunner(self.isolation, self.tiers)
        self.pipeline = StepPipeline(
            self.scheduler, stepping, async_scheduling, isolation=self.isolation
        )
        self.model_info = ModelInfo(
            served_model_name=config.model_name,
            max_model_len=self.scheduler.max_model_len,
            vocab_size=loaded.config.vocab_size,
            eos_token_ids=loaded.config.eos_token_ids,
            num_blocks=num_blocks,
            block_size=config.block_size,
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(device),
            runner=kind,
            runner_reason=reason,
            architecture=loaded.config.architecture,
            num_parameters=loaded.config.num_parameters(),
            memory_profile=self.memory_profile.to_dict() if self.memory_profile else None,
            async_scheduling=async_scheduling,
            revision=config.revision,
            speculative=config.speculative_config.to_info() if config.speculative_config else None,
            kv_offload=dict(self.tiers.info) if self.tiers is not None else None,
            tensor_parallel_size=config.tensor_parallel_size,
        )
        self._aborted: list[RequestDelta] = []
        logger.info(
            "engine core ready: runner %s (%s), %d KV blocks, max_model_len %d",
            kind,
            reason,
            num_blocks,
            self.scheduler.max_model_len,
        )

    def add_request(self, req: EngineRequest) -> None:
        """Validate and queue a tokenized request (ParamError / QueueFullError on refusal).

        Every request is checked here, whoever sends it (the API process, the offline `LLM`,
        a benchmark): its sampling parameters (`SamplingParams.validate`, the same validation
        the API process reports under the client's names), what the runner can run
        (`runner.capability`), and the scheduler's limits.
        """
        if self.config.logits_processors:  # --logits-processors apply to every request
            names = self.config.logits_processors + tuple(
                n for n in req.sampling.logits_processors if n not in self.config.logits_processors
            )
            req = dataclasses.replace(
                req, sampling=dataclasses.replace(req.sampling, logits_processors=names)
            )
        req.sampling.validate(self.config.max_logprobs)
        info = self.model_info
        check_request(info.runner, info.vocab_size, req.prompt_token_ids, req.sampling)
        if not req.eos_token_ids:
            req = dataclasses.replace(req, eos_token_ids=self.model_info.eos_token_ids)
        self.scheduler.add_request(req)

    def abort_requests(self, ids: Iterable[str]) -> None:
        """Abort requests now (blocks freed); each known one gets an ABORT delta next step."""
        for request_id in ids:
            req = self.scheduler.get_request(request_id)
            if req is None:
                continue
            num_prompt, num_cached = req.num_prompt_tokens, req.num_cached_tokens
            if self.scheduler.abort(request_id):
                self._aborted.append(
                    RequestDelta(
                        request_id=request_id,
                        new_token_ids=[],
                        finish_reason=FinishReason.ABORT,
                        num_prompt_tokens=num_prompt,
                        num_cached_tokens=num_cached,
                    )
                )

    def check_health(self) -> None:
        """Raise RankFailedError (naming the rank) once a tensor-parallel rank has died."""
        if self.ranks is not None:
            self.ranks.check()

    def step(self) -> list[RequestDelta]:
        """Run one scheduler step; returns the deltas it produced (aborts first)."""
        self.check_health()
        if (
            self.tiers is not None
            and not self._aborted
            and not self.scheduler.has_runnable
            and not self.pipeline.has_in_flight
        ):
            # Only loads from the offload tiers are pending: wait for them a moment instead of
            # spinning through empty steps.
            self.tiers.wait(_IDLE_LOAD_WAIT_S)
        deltas, self._aborted = self._aborted, []
        deltas.extend(self.pipeline.step())
        deltas.extend(self.isolation.take_failed())
        return deltas

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or self.pipeline.has_in_flight

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()
        if self.tiers is not None:
            stats.kv_offload = self.tiers.stats()
        return stats

    def shutdown(self) -> None:
        """Release the device; the offload tiers first finish their copies and write the CPU
        tier's blocks to the disk tier (bounded in time), so a restart finds them."""
        if self.tiers is not None:
            self.tiers.close(persist=True)
        self.runner.shutdown()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
