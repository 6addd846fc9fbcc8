"""One request's failure inside a step fails that request only.

A step runs every scheduled request in one batch, so an exception from the runner does not say
whose it is: a custom logits processor that raises on one request's tokens, a value that one
request's parameters push out of range. `IsolatingRunner` wraps the engine's runner; when a
step raises, it runs the step's requests again in halves, then halves of the failing half, and
so on, until each failing request ran alone. Those requests are finished with
`FinishReason.ERROR` (`take_failed()` hands their deltas to the engine core, which sends them
like any other); every other request gets its token from the smaller runs, so its output is
exactly what the whole step would have given it.

This needs a runner whose steps can run again after one raised (`ModelRunner.repeatable_steps`).
Every run after a failure gets its rows restated (`restate`): marked `is_new`, so a runner with
per-request state (V2: slots, device token rows, block tables, sampling parameters) rebuilds
each request's state from the scheduler's view, as after a preemption, instead of trusting what
the failed step left half-applied. With asynchronous scheduling a step may fail at its launch
or when its tokens are read, while another one is launched after it: `StepPipeline` then lands
or runs again, in order, every step before it, discards the steps after it, and runs each of
them again here (`execute` of `restated(...)`), so the failing one is isolated like any other.

Fatal, since no request is to blame: a `RunnerFailure` (the runner itself is broken), a device
that runs no more work after the failure (`DeviceFailure`: a sticky CUDA error such as an
illegal memory access, told apart by `runner.base.check_device`), a step where every one of
several requests fails alone, and MAX_FAILED_STEPS steps in a row where nothing ran. A runner
without repeatable steps also stops the core, as half-applied state cannot be trusted.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from davit_engine.core.batch import RunnerOutput, ScheduledRequest, SchedulerOutput
from davit_engine.core.scheduler import Scheduler
from davit_engine.runner.base import ModelRunner, PendingOutput, RunnerFailure, check_device
from davit_engine.types import FinishReason, RequestDelta

logger = logging.getLogger(__name__)

# Steps in a row that failed for every request before the core gives up.
MAX_FAILED_STEPS = 8


class IsolatingRunner(ModelRunner):
    """Delegates to `runner`; isolates a failing step's requests (see the module)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.name = runner.name
        self.repeatable_steps = runner.repeatable_steps  # type: ignore[misc]
        self._failed: list[RequestDelta] = []
        self._failed_steps = 0

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def shutdown(self) -> None:
        self.runner.shutdown()

    def take_failed(self) -> list[RequestDelta]:
        """ERROR deltas of the requests that failed since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        try:
            output = self.runner.execute(batch)
        except Exception as exc:
            if not self.isolatable(batch, exc):
                raise
            return self._isolate(batch, exc)
        self._failed_steps = 0
        return output

    def isolatable(self, batch: SchedulerOutput, error: Exception) -> bool:
        """Whether `batch` may run again, in parts, after `error`: it has requests, the runner's
        steps are repeatable and `error` is no RunnerFailure. Raises DeviceFailure (from the
        device check) when the device runs no more work."""
        if not batch.scheduled or not self.runner.repeatable_steps:
            return False
        if isinstance(error, RunnerFailure):
            return False
        check_device(error)
        return True

    def _isolate(self, batch: SchedulerOutput, error: Exception) -> RunnerOutput:
        scheduled = batch.scheduled
        logger.warning(
            "a step of %d request(s) failed (%s: %s); running them in smaller batches to find "
            "the failing one(s)",
            len(scheduled),
            type(error).__name__,
            error,
        )
        outputs: list[tuple[list[int], RunnerOutput]] = []
        failures: list[tuple[int, Exception]] = []

        def run(rows: list[int], known_failure: Exception | None) -> None:
            if known_failure is None:
                # Released by the failed run already: a part that released them again could
                # free the slot of a new request with a finished one's id.
                part = dataclasses.replace(
                    batch,
                    scheduled=[restate(scheduled[i]) for i in rows],
                    finished_ids=[],
                    preempted_ids=[],
                )
                try:
                    outputs.append((rows, self.runner.execute(part)))
                    return
                except RunnerFailure:
                    raise
                except Exception as exc:
                    check_device(exc)  # the device may have broken in this very run
                    known_failure = exc
            if len(rows) == 1:
                failures.append((rows[0], known_failure))
                return
            middle = len(rows) // 2
            run(rows[:middle], None)
            run(rows[middle:], None)

        run(list(range(len(scheduled))), error)
        if outputs:
            self._failed_steps = 0
        else:
            self._failed_steps += 1
            if len(scheduled) > 1 or self._failed_steps >= MAX_FAILED_STEPS:
                raise error  # nothing ran: not one request's failure
        for row, exc in failures:
            self._fail(scheduled[row].request_id, exc)
        return merge_outputs(outputs, len(scheduled))

    def _fail(self, request_id: str, error: Exception) -> None:
        logger.error("request %s failed in the engine; finishing it", request_id, exc_info=error)
        request = self.scheduler.get_request(request_id)
        if request is None or not self.scheduler.abort(request_id):
            return
        self._failed.append(
            RequestDelta(
                request_id=request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens,
                error=type(error).__name__,
            )
        )

    def execute_async(self, batch: SchedulerOutput) -> PendingOutput:
        # A failed launch (or result) is isolated by the pipeline, which knows the steps around
        # it: it runs the step again through `execute` once the steps before it have landed.
        return self.runner.execute_async(batch)


class AsyncIsolatingRunner(IsolatingRunner):
    """The wrapper of a runner that schedules asynchronously."""

    supports_async_scheduling = True


def isolating(runner: ModelRunner, scheduler: Scheduler) -> IsolatingRunner:
    """`runner` wrapped, keeping its asynchronous-scheduling capability."""
    if runner.supports_async_scheduling:
        return AsyncIsolatingRunner(runner, scheduler)
    return IsolatingRunner(runner, scheduler)


def restate(request: ScheduledRequest) -> ScheduledRequest:
    """`request`'s share of a step, to run again after a failure: `is_new`, so a runner with
    per-request state rebuilds it from `token_ids` (which must hold every token before this
    step's: the steps before it have landed), and no tokens pending."""
    return dataclasses.replace(request, is_new=True, num_pending_tokens=0)


def restated(batch: SchedulerOutput, scheduler: Scheduler) -> SchedulerOutput:
    """`batch` to run again once every step before it has landed: the rows of requests still
    live (not finished, aborted or failed meanwhile), restated. Its finished and preempted ids
    stay, as a launch that failed early may not have released them; releasing one again is
    harmless, since a request that took such an id's slot since is a restated row of this step
    or of the discarded one after it."""
    live = []
    for request in batch.scheduled:
        current = scheduler.get_request(request.request_id)
        # The token list identifies the request: an id can be reused after a finish.
        if current is not None and current.token_ids is request.token_ids:
            live.append(restate(request))
    return dataclasses.replace(batch, scheduled=live)


def merge_outputs(outputs: Sequence[tuple[list[int], RunnerOutput]], num_rows: int) -> RunnerOutput:
    """The outputs of runs over some rows of a batch as one output for all `num_rows` rows.

    Every field of RunnerOutput is one entry per row, or None; a row no run covered gets None
    (its request failed and is finished already).
    """
    columns: dict[str, Any] = {}
    for column in dataclasses.fields(RunnerOutput):
        merged: list[Any] | None = None
        for rows, output in outputs:
            values = getattr(output, column.name)
            if values is None:
                continue
            if merged is None:
                merged = [None] * num_rows
            for value, row in zip(values, rows, strict=True):
                merged[row] = value
        columns[column.name] = merged
    if columns["sampled_token_ids"] is None:
        columns["sampled_token_ids"] = [None] * num_rows
    return RunnerOutput(**columns)
