"""The runner interface that runner V1 and runner V2 both implement."""

from __future__ import annotations

import abc
from typing import ClassVar, Protocol

from davit_engine.core.batch import RunnerOutput, SchedulerOutput


class RunnerFailure(RuntimeError):
    """The runner cannot run any step any more (a tensor-parallel rank died, ...): fatal for
    the engine core, never one request's failure to isolate."""


class PendingOutput(Protocol):
    """A launched step; `result()` waits for its sampled tokens."""

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
    - A runner with `repeatable_steps` keeps no per-request state from one step to the next: after
      `execute(batch)` raised, running the batch again, or parts of it, is safe (the engine core
      then isolates the failing request instead of stopping).
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
