"""Runner V2: persistent GPU request state, GPU input preparation and sampling, CUDA graphs."""

from davit_engine.runner.v2.pending import PendingStep
from davit_engine.runner.v2.runner import RunnerV2

__all__ = ["PendingStep", "RunnerV2"]
