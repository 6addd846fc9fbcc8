"""The engine loop's step: schedule → execute → update, synchronously or one step ahead.

Synchronous: each `step()` schedules a batch, runs it and applies its tokens.

Asynchronous scheduling (runners with `supports_async_scheduling`): `step()` schedules batch
N+1 and launches it while batch N still runs on the device, then waits for N's sampled tokens
(the loop's only host-device synchronisation) and applies them. The device never waits for the
host's scheduling and bookkeeping. Tokens of N that N+1 consumes are placeholders the runner
reads from its own device state; a request that N finishes (EOS, a stop token) has one extra
token computed by N+1, which `Scheduler.update_from_output` drops. Requests known to finish when
their pending token lands (max_tokens, max_model_len) are not scheduled again. So the tokens are
the same as with synchronous steps; only a step's composition may differ, since blocks and
sequence slots of a request finishing at N are freed one step later.

Speculative decoding: drafts are proposed from a request's latest tokens, and how many tokens a
verification step adds is known only once it lands, so when step N holds requests that may
speculate (`SchedulerOutput.wants_host_tokens`), `step()` applies N's tokens before it
schedules N+1; the device then idles for the host's scheduling of N+1. Steps of requests that
cannot speculate (and every step without speculative decoding) keep the one-step-ahead
pipeline.

A step that fails (`IsolatingRunner`): synchronously the isolating runner runs its requests
again in parts. Asynchronously a step N+1 may fail at its launch, or step N when its tokens
are read while N+1 is launched already. Steps are then recovered in order: N lands if it can;
a failed N runs again synchronously through the isolating runner (rows restated, so the
runner rebuilds their state instead of trusting what the failure left); N+1, launched on top of
a failed N or failed itself, is discarded and runs again the same way. Every step before a rerun
has landed by then, so its rows' tokens are all on the host, and the outputs are the ones the
steps would have given.
"""

from __future__ import annotations

import logging

from davit_engine.core.batch import SchedulerOutput
from davit_engine.core.scheduler import Scheduler
from davit_engine.isolating_runner import IsolatingRunner, restated
from davit_engine.runner.base import ModelRunner, PendingOutput
from davit_engine.types import RequestDelta

logger = logging.getLogger(__name__)


class StepPipeline:
    """Drives `scheduler` and `runner`; at most one launched step is unread at a time.

    `async_scheduling=True` needs a runner with `supports_async_scheduling` (ValueError
    otherwise). `isolation` is the isolating runner inside `runner` (`runner` itself when it is
    one): with it, a failed launch or result is recovered as the module says; without it, any
    failure propagates. Not thread-safe: one loop thread calls `step()`; aborts go to the
    scheduler between steps.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        async_scheduling: bool,
        isolation: IsolatingRunner | None = None,
    ) -> None:
        if async_scheduling and not runner.supports_async_scheduling:
            raise ValueError(f"runner {runner.name} does not support asynchronous scheduling")
        self.scheduler = scheduler
        self.runner = runner
        self.async_scheduling = async_scheduling
        if isolation is None and isinstance(runner, IsolatingRunner):
            isolation = runner
        self.isolation = isolation
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None

    @property
    def has_in_flight(self) -> bool:
        """Whether a launched step's tokens are still to be applied."""
        return self._in_flight is not None

    def step(self) -> list[RequestDelta]:
        """One step; returns the deltas of the step(s) whose tokens were applied."""
        landed: list[RequestDelta] = []
        if self._in_flight is not None and self._in_flight[0].wants_host_tokens:
            landed = self._settle()
        batch = self.scheduler.schedule()
        has_work = not batch.is_empty
        # Runner V2 keeps per-request state: it must see finished/preempted ids even on a step
        # that schedules nothing.
        if not has_work and not batch.finished_ids and not batch.preempted_ids:
            return landed + self._settle()
        if not self.async_scheduling:
            output = self.runner.execute(batch)
            return self.scheduler.update_from_output(batch, output)
        try:
            pending = self.runner.execute_async(batch)
        except Exception as exc:
            self._check_recoverable(batch, exc, "launch")
            # The step before lands first: this one's inputs include its tokens.
            landed += self._settle()
            return landed + self._run_again(batch)
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            try:
                output = previous[1].result()
            except Exception as exc:
                self._check_recoverable(previous[0], exc, "result")
                # This step ran on the failed one's device state: discard it, run both again.
                landed += self._run_again(previous[0])
                return landed + self._run_again(batch)
            landed += self.scheduler.update_from_output(previous[0], output)
        if has_work:
            self._in_flight = (batch, pending)
        else:
            pending.result()  # slot releases only: no tokens, nothing to wait for
        return landed

    def _settle(self) -> list[RequestDelta]:
        if self._in_flight is None:
            return []
        batch, pending = self._in_flight
        self._in_flight = None
        try:
            output = pending.result()
        except Exception as exc:
            self._check_recoverable(batch, exc, "result")
            return self._run_again(batch)
        return self.scheduler.update_from_output(batch, output)

    def _check_recoverable(self, batch: SchedulerOutput, error: Exception, where: str) -> None:
        """Re-raise `error` (a launch's or a result's) unless the isolating runner can run
        `batch` again; DeviceFailure when the device runs no more work."""
        if self.isolation is None or not self.isolation.isolatable(batch, error):
            raise error
        logger.warning(
            "the %s of a step of %d request(s) failed (%s: %s); running it again synchronously",
            where,
            len(batch.scheduled),
            type(error).__name__,
            error,
        )

    def _run_again(self, batch: SchedulerOutput) -> list[RequestDelta]:
        """Run a failed or discarded step again, synchronously, once the steps before it have
        landed (the isolating runner fails the requests that still fail) and apply it."""
        again = restated(batch, self.scheduler)
        output = self.runner.execute(again)
        return self.scheduler.update_from_output(again, output)
