"""Runner rules of one engine release: what sends it to runner V1, what each runner refuses.

For vLLM every rule is one entry of the release's own lists, read from its wheel by the catalog
evidence tool (`tools/davit_tools/catalog/evidence/vllm-VERSION.json`): `text` is the release's
wording, `effects` what the release does with it (the evidence's `summary.effects`), and `when`
the operator's reading of the release's condition in terms of the spec. A rule without `when`
is recorded for completeness but never evaluated: the spec cannot ask for it (the operator sets
nothing that reaches it) or it depends on something unknown before the engine starts (Triton in
the image, the platform). The `model` condition marks rules that depend on the model's
architecture: they are never true, but status names them (in plain words: `note`) as what the
release may still decide by itself.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from davit_operator.api.spec import SpeculativeMethod
from davit_operator.catalog.base import CatalogModel, RunnerName, VariantName

# What a release does with a rule whose condition holds:
# - selectsV1OnAuto: with the runner left to the release, it runs runner V1;
# - refusedOnV2 / refusedOnV1: that runner's validation refuses the spec (a forced runner, or
#   the one auto selection arrived at);
# - refused: the only runner of a single-runner release refuses the spec;
# - refusedOnStandaloneCpu: the standalone CPU runner refuses it (vLLM 0.34.0 uses that runner
#   only on non-x86 CPUs without Triton);
# - forcesV2: the release runs or requires runner V2 (features only V2 has).
Effect = Literal[
    "selectsV1OnAuto", "refusedOnV2", "refusedOnV1", "refused", "refusedOnStandaloneCpu", "forcesV2"
]
EFFECTS: tuple[Effect, ...] = (
    "selectsV1OnAuto",
    "refusedOnV2",
    "refusedOnV1",
    "refused",
    "refusedOnStandaloneCpu",
    "forcesV2",
)
TWO_RUNNER_EFFECTS: frozenset[Effect] = frozenset({"selectsV1OnAuto", "refusedOnV2", "refusedOnV1"})

# Spec facts a rule's condition is made of (all must hold):
Condition = Literal[
    "sequenceParallelism",  # parallelism.sequenceParallelism
    "dualBatchOverlap",  # parallelism.dualBatchOverlap
    "elasticExpertParallelism",  # parallelism.expert.elastic
    "customLogitsProcessors",  # features.customLogitsProcessors
    "tensorParallelism",  # parallelism.tensor > 1
    "pipelineParallelism",  # parallelism.pipeline > 1
    "speculativeDecoding",  # features.speculative set
    "speculativeMethod",  # features.speculative.method in `methods`
    "lora",  # --enable-lora in engine.extraArgs (the API has no LoRA field)
    "kvCacheOffloading",  # features.kvCacheOffloading set
    "fp8",  # engine.quantization, engine.lmHeadQuantization or engine.kvCacheDtype fp8 (not int8)
    "model",  # the model's architecture: unknown to the operator, never true
]


class RunnerSwitch(CatalogModel):
    """How a release is told which runner to use: a command-line flag taking the runner's name,
    or an environment variable with a value per runner. A release that reads none has
    `runnerSwitch: null` (one runner)."""

    kind: Literal["flag", "env"]
    name: str
    values: dict[RunnerName, str] = Field(default_factory=dict)


class RunnerRule(CatalogModel):
    text: str = Field(min_length=1)
    effects: list[Effect] = Field(min_length=1)
    when: list[Condition] | None = None
    methods: list[SpeculativeMethod] | None = None
    variants: list[VariantName] | None = None
    note: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> RunnerRule:
        if len(set(self.effects)) != len(self.effects):
            raise ValueError(f"{self.text}: effects are listed twice")
        uses_methods = self.when is not None and "speculativeMethod" in self.when
        if uses_methods != (self.methods is not None):
            raise ValueError(f"{self.text}: methods go with (and only with) speculativeMethod")
        if self.when == [] and not self.variants:
            raise ValueError(f"{self.text}: an unconditional rule must name its variants")
        return self

    @property
    def evaluated(self) -> bool:
        """Whether planning evaluates this rule (it has a condition and no model part)."""
        return self.when is not None and "model" not in self.when

    def applies_to(self, variant: str) -> bool:
        return self.variants is None or variant in self.variants
