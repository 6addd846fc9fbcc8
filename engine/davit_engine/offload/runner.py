"""The runner as the step pipeline sees it with KV offload: queued stores go out first.

Before each step launches, the tiers copy the blocks whose copies are due (`KvTiers.flush`):
the GPU gather of a store is launched on the runner's stream ahead of the step, so a block the
step reuses is read before the step overwrites it.
"""

from __future__ import annotations

from davit_engine.core.batch import RunnerOutput, SchedulerOutput
from davit_engine.offload.tiers import KvTiers
from davit_engine.runner.base import ModelRunner, PendingOutput


class OffloadingRunner(ModelRunner):
    """Delegates to `runner` (sizing and initialisation included) after `tiers.flush()`."""

    def __init__(self, runner: ModelRunner, tiers: KvTiers) -> None:
        self.runner = runner
        self.tiers = tiers
        self.name = runner.name
        self.supports_async_scheduling = runner.supports_async_scheduling  # type: ignore[misc]
        self.repeatable_steps = runner.repeatable_steps  # type: ignore[misc]

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        self.tiers.flush()
        return self.runner.execute(batch)

    def execute_async(self, batch: SchedulerOutput) -> PendingOutput:
        self.tiers.flush()
        return self.runner.execute_async(batch)

    def shutdown(self) -> None:
        self.runner.shutdown()
