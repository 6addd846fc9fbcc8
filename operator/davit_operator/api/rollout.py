"""`spec.rollout` and the rollout parts of the status: how a changed spec reaches the replicas.

A revision is the engine pod template a spec produces (image, arguments, environment,
resources); replica counts are not part of it. `Rolling` hands the new revision to the
Deployment controller within surge limits; `Canary` runs the new revision as a second Deployment
behind the same Service and moves traffic to it step by step (through replica ratios), gated on
the error ratio and the p95 time to first token read from the canary engines' own metrics.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from davit_operator.api.schema import CrdModel, Quantity, cel_rule, object_default

RolloutStrategy = Literal["Rolling", "Canary"]
RolloutPhase = Literal["Complete", "Progressing", "Paused", "Promoting", "RolledBack", "Failed"]
RevisionOutcome = Literal["Progressing", "Succeeded", "RolledBack", "Superseded"]

ROLLOUT_PROGRESSING = "RolloutProgressing"


class RollingSpec(CrdModel):
    max_surge: Quantity = Field(
        default=0,
        description="Extra replicas (count or percentage) started above spec.replicas during "
        "an update. 0 by default: accelerators are scarce.",
    )
    max_unavailable: Quantity = Field(
        default=1,
        description="Replicas (count or percentage) that may be unavailable during an update.",
    )


class CanaryStep(CrdModel):
    weight: int = Field(
        ge=1, le=100, description="Percent of the replicas (the traffic) on the new revision."
    )
    pause_seconds: int = Field(
        default=60,
        ge=0,
        le=86_400,
        description="How long the step holds, once its canary replicas are ready, before the "
        "analysis may promote it to the next step.",
    )


class CanarySpec(CrdModel):
    steps: list[CanaryStep] = Field(
        min_length=1,
        max_length=20,
        description="Traffic steps, in order; after the last one the new revision becomes "
        "stable. Weights are realised as replica ratios (at least one canary replica), or "
        "on an HTTPRoute (see httpRoute).",
    )
    http_route: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="An HTTPRoute (Gateway API) in this namespace whose rules send traffic to "
        "this InferenceService's Service. Where the Gateway API is installed the operator "
        "creates the Services NAME-stable and NAME-canary and sets each such rule's "
        "backendRefs to them with the step's weights; the stable side keeps all its replicas. "
        "Without the Gateway API, weights fall back to replica ratios.",
    )


class AnalysisSpec(CrdModel):
    max_error_ratio: float = Field(
        default=0.05,
        ge=0.0,
        le=1.0,
        description="Largest tolerated share of failed generation requests on the canary "
        "(HTTP answers other than 2xx and 429, from the engines' http_requests_total).",
    )
    max_ttft_p95_seconds: float | None = Field(
        default=None,
        gt=0.0,
        description="Largest tolerated p95 time to first token on the canary, from the "
        "vllm:time_to_first_token_seconds histogram; unchecked when unset.",
    )
    interval_seconds: int = Field(
        default=10, ge=1, le=3600, description="How often the canary's metrics are read."
    )
    min_requests: int = Field(
        default=10,
        ge=1,
        le=1_000_000,
        description="Requests the canary must have answered before a step can be judged.",
    )


class RolloutSpec(CrdModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "self.strategy != 'Canary' || has(self.canary)",
                    "rollout.canary (with steps) is required when rollout.strategy is Canary",
                    ".canary",
                    reason="FieldValueRequired",
                ),
                cel_rule(
                    "self.strategy == 'Canary' || !has(self.canary)",
                    "rollout.canary only applies to strategy Canary",
                    ".canary",
                ),
            ]
        }
    )

    strategy: RolloutStrategy = Field(
        default="Rolling",
        description="Rolling: the Deployment controller replaces replicas within the surge "
        "limits. Canary: a second Deployment takes traffic step by step, gated on metrics.",
    )
    rolling: RollingSpec = Field(
        default_factory=RollingSpec,
        json_schema_extra={"default": object_default(RollingSpec)},
        description="Surge limits (both strategies; the canary's promotion uses them too).",
    )
    canary: CanarySpec | None = Field(default=None, description="Canary steps.")
    analysis: AnalysisSpec = Field(
        default_factory=AnalysisSpec,
        json_schema_extra={"default": object_default(AnalysisSpec)},
        description="Thresholds the canary must meet at every step.",
    )
    progress_deadline_seconds: int = Field(
        default=600,
        ge=10,
        le=86_400,
        description="How long replicas of a new revision may take to become ready (per "
        "canary step: to become ready and gather minRequests) before the rollout fails.",
    )
    auto_rollback: bool = Field(
        default=True,
        description="Return to the last good revision when the rollout fails.",
    )
    paused: bool = Field(
        default=False,
        description="Hold the rollout where it is (Rolling: the Deployment is paused; Canary: "
        "the current step holds). Set back to false to resume.",
    )
    drain_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        description="Seconds an engine gets to finish in-flight requests after SIGTERM; the "
        "pods' termination grace period covers it plus the pre-stop delay.",
    )


class AnalysisResult(CrdModel):
    requests: int = Field(ge=0, description="Generation requests answered by the canary.")
    errors: int = Field(ge=0, description="Of those, answers other than 2xx and 429.")
    error_ratio: float | None = Field(default=None, description="errors / requests.")
    ttft_p95_seconds: float | None = Field(
        default=None, description="p95 time to first token (histogram bucket bound)."
    )
    pods: int = Field(ge=0, description="Canary pods whose metrics were read.")
    at: str = Field(max_length=64, description="RFC 3339 time of the reading.")


class RolloutStatus(CrdModel):
    phase: RolloutPhase = Field(description="Where the rollout stands.")
    strategy: RolloutStrategy = Field(description="Strategy of the current rollout.")
    stable_revision: str | None = Field(
        default=None, max_length=64, description="Revision the stable replicas run."
    )
    target_revision: str | None = Field(
        default=None, max_length=64, description="Revision the spec asks for."
    )
    step: int | None = Field(default=None, ge=0, description="Canary step index (0-based).")
    weight: int | None = Field(default=None, ge=0, le=100, description="Canary traffic percent.")
    step_started_at: str | None = Field(
        default=None, max_length=64, description="When the current step (or rollout) started."
    )
    step_ready_at: str | None = Field(
        default=None, max_length=64, description="When the current step's replicas were ready."
    )
    message: str = Field(default="", max_length=4096, description="What happens now.")
    analysis: AnalysisResult | None = Field(
        default=None, description="The latest reading of the canary's metrics."
    )
    routing: str | None = Field(
        default=None,
        max_length=300,
        description="How canary traffic is split: ReplicaRatio, or HTTPRoute/NAME.",
    )
    stable_spec: str | None = Field(
        default=None,
        max_length=262_144,
        description="The spec of the stable revision (JSON), which a rollback restores.",
    )


class RevisionRecord(CrdModel):
    revision: str = Field(max_length=64, description="Hash of the engine pod template.")
    image: str = Field(max_length=512, description="Image reference.")
    digest: str | None = Field(default=None, max_length=128, description="Image digest.")
    engine_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, description="Effective engine command line."
    )
    strategy: RolloutStrategy = Field(description="How it was rolled out.")
    started_at: str = Field(max_length=64, description="When its rollout started.")
    finished_at: str | None = Field(default=None, max_length=64, description="When it ended.")
    outcome: RevisionOutcome = Field(description="Progressing, Succeeded, RolledBack, Superseded.")
    reason: str = Field(default="", max_length=128, description="CamelCase reason.")
    message: str = Field(default="", max_length=4096, description="Why it ended this way.")


MAX_REVISIONS = 10
