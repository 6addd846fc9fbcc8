"""The runner interface that runner V1 and runner V2 both implement."""

from __future__ import annotations

import abc
from typing import ClassVar, Protocol

import torch

from davit_engine.core.batch import RunnerOutput, SchedulerOutput


class RunnerFailure(RuntimeError):
    """The runner cannot run any step any more (a tensor-parallel rank died, ...): fatal for
    the engine core, never one request's failure to isolate."""


class DeviceFailure(RunnerFailure):
    """The accelerator runs no more work after a step failed (a sticky CUDA error such as an
    illegal memory access or a device-side assert): every later step would fail too, so the
    engine core stops and the process must be restarted."""


def check_device(error: BaseException) -> None:
    """Raise DeviceFailure (naming `error` and what the device answered) when the CUDA device
    this process uses can run no more work after `error`; return when it still can (or no CUDA
    device was used), so the failure may be one request's.

    A sticky error fails every later call on the device, so a synchronisation and one tiny
    kernel tell it apart from an error the device survived (a Python exception, a refused
    launch, an allocation that did not fit)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).cpu()
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        cause = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise DeviceFailure(
            f"the CUDA device can run no more work ({reason}) after a step failed with "
            f"{type(error).__name__}: {cause}; this is not one request's failure, the engine "
            "must be restarted"
        ) from exc


class PendingOutput(Protocol):
    """A launched step; `result()` waits for its sampled tokens. A step whose result is never
    read (the pipeline discards it after a failure) needs no call: the runner's later steps
    run after it on the device."""

    def result(self) -> RunnerOutput: ...


class ModelRunner(abc.ABC):
    """Owns the device: weights, the paged KV cache, input preparation, forward and sampling.

    Contract:
    - `determine_num_blocks()` is called once after the weights are loaded and returns how many
      KV blocks fit (from the explicit override, or by profiling memory); then
      `initialize_kv_cache(n)` allocates exactly `n` blocks of `block_size` tokens.
    - `execute(batch)` runs one step and returns one entry per scheduled request, in order.
      Sampling is reproducible per request when `SamplingParams.seed` is set, independent of
      which other requests share the batch.
    - Block ids in `batch` index the KV cache allocated here; the runner never allocates blocks.
    - A runner with `supports_async_scheduling` also has `execute_async(batch)`, which launches
      the step and returns before its tokens are on the host; the next step may be launched
      before the previous `result()`, with placeholders (`ScheduledRequest.num_pending_tokens`)
      for tokens still in flight.
    - A runner with `repeatable_steps` can run a step again after it raised: after
      `execute(batch)` or a launch (or the `result()` of one) raised, running the batch again,
      or parts of it, is safe once every row is restated, that is marked `is_new` with complete
      `token_ids` and no pending tokens (`isolating_runner.restate`). A runner that keeps no
      per-request state (V1) runs such rows as any other; one that keeps it (V2) rebuilds a
      restated request's state from the row, as after a preemption, whatever a failed step
      left behind. The engine core then isolates the failing request instead of stopping.
    """

    name: str = "base"
    supports_async_scheduling: ClassVar[bool] = False
    repeatable_steps: ClassVar[bool] = False

    @abc.abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abc.abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abc.abstractmethod
    def execute(self, batch: SchedulerOutput) -> RunnerOutput: ...

    def execute_async(self, batch: SchedulerOutput) -> PendingOutput:
        """Launch one step (runners with `supports_async_scheduling` only)."""
        raise NotImplementedError(f"runner {self.name} runs steps synchronously")

    def shutdown(self) -> None:  # noqa: B027 - optional hook, most runners need nothing
        """Release device resources. Safe to call twice."""
