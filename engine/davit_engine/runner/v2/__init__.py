"""Runner V2: persistent GPU request state, GPU input preparation and sampling, CUDA graphs."""

from davit_engine.runner.v2.runner import PendingStep, RunnerV2

__all__ = ["PendingStep", "RunnerV2"]
