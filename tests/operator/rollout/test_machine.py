"""The rollout state machine (pure): canary steps, gates, rollback, pause, rolling, history."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from davit_operator.api.rollout import RolloutSpec
from davit_operator.rollout.machine import (
    Decision,
    Inputs,
    Observed,
    Target,
    canary_split,
    decide,
)
from davit_operator.rollout.metrics import Reading, Sample

T0 = 1_800_000_000.0
OLD = Target("aaaaaaaaaa", '{"v":1}', "img:1", None, ("davit", "serve", "m"))
NEW = Target("bbbbbbbbbb", '{"v":2}', "img:2", "sha256:2", ("davit", "serve", "m", "--x"))


def canary_spec(**analysis: Any) -> RolloutSpec:
    return RolloutSpec.model_validate(
        {
            "strategy": "Canary",
            "canary": {"steps": [{"weight": 25, "pauseSeconds": 30}, {"weight": 50}]},
            "analysis": {"minRequests": 10, "maxErrorRatio": 0.1, **analysis},
            "progressDeadlineSeconds": 120,
        }
    )


def steady(stable: Target = OLD) -> dict[str, Any]:
    return {
        "phase": "Complete",
        "strategy": "Canary",
        "stableRevision": stable.revision,
        "targetRevision": stable.revision,
        "stableSpec": stable.spec_json,
        "message": "",
    }


def observed(
    *,
    stable_rev: str | None = OLD.revision,
    stable_done: bool = True,
    canary_rev: str | None = None,
    canary_ready: int = 0,
    deadline: bool = False,
) -> Observed:
    return Observed(
        stable_done=stable_done,
        stable_revision=stable_rev,
        stable_deadline_exceeded=deadline,
        canary_revision=canary_rev,
        canary_ready=canary_ready,
    )


def reading(requests: int, errors: int, ttft: dict[float, float] | None = None) -> Reading:
    buckets = ttft if ttft is not None else {0.1: float(requests), float("inf"): float(requests)}
    return Reading(Sample(requests, errors, requests - errors, buckets), 1, ())


class World:
    """Feeds each decision's status back as the next reconcile's input."""

    def __init__(self, spec: RolloutSpec, replicas: int = 4) -> None:
        self.spec = spec
        self.replicas = replicas
        self.old: dict[str, Any] = steady()
        self.revisions: list[dict[str, Any]] = [
            {
                "revision": OLD.revision,
                "image": OLD.image,
                "engineArgs": list(OLD.engine_args),
                "strategy": "Rolling",
                "startedAt": "2027-01-15T08:00:00Z",
                "outcome": "Succeeded",
            }
        ]
        self.events: list[tuple[str, str, str]] = []

    def step(
        self,
        now: float,
        obs: Observed,
        read: Reading | None = None,
        target: Target = NEW,
    ) -> Decision:
        d = decide(
            Inputs(
                spec=self.spec,
                replicas=self.replicas,
                target=target,
                old=self.old,
                revisions=self.revisions,
                observed=obs,
                reading=read,
                now=now,
            )
        )
        self.old, self.revisions = d.rollout, d.revisions
        self.events += d.events
        return d


@pytest.mark.parametrize(
    ("replicas", "weight", "split"),
    [(4, 25, (1, 3)), (4, 50, (2, 2)), (1, 50, (1, 1)), (3, 10, (1, 3)), (2, 100, (2, 0))],
)
def test_weights_become_replica_ratios(replicas: int, weight: int, split: tuple[int, int]) -> None:
    assert canary_split(replicas, weight) == split


def test_a_canary_that_passes_is_promoted_through_every_step() -> None:
    w = World(canary_spec())
    d = w.step(T0, observed())
    assert (d.canary_replicas, d.stable_replicas, d.stable_spec_json) == (1, 3, OLD.spec_json)
    assert d.rollout["phase"] == "Progressing" and d.rollout["step"] == 0
    assert d.condition[:2] == ("True", "CanaryStep")
    assert w.revisions[-1]["revision"] == NEW.revision
    assert w.revisions[-1]["outcome"] == "Progressing"
    assert w.events[-1][1] == "RolloutStarted"
    # Ready canary, too few requests: the step waits even after its pause.
    d = w.step(T0 + 10, observed(canary_rev=NEW.revision, canary_ready=1), reading(3, 0))
    assert d.rollout["stepReadyAt"] and d.rollout["step"] == 0
    d = w.step(T0 + 45, observed(canary_rev=NEW.revision, canary_ready=1), reading(8, 0))
    assert d.rollout["step"] == 0, "minRequests not reached"
    d = w.step(T0 + 50, observed(canary_rev=NEW.revision, canary_ready=1), reading(12, 1))
    assert d.rollout["step"] == 1 and d.rollout["weight"] == 50
    assert (d.canary_replicas, d.stable_replicas) == (2, 2)
    assert w.events[-1][1] == "StepPassed" and "12 requests, 1 errors" in w.events[-1][2]
    # Step 2 restarts its readiness clock: 1 ready canary replica is not enough for 50%.
    d = w.step(T0 + 55, observed(canary_rev=NEW.revision, canary_ready=1), reading(20, 1))
    assert d.rollout["phase"] == "Progressing" and "waiting for 2" in d.rollout["message"]
    d = w.step(T0 + 60, observed(canary_rev=NEW.revision, canary_ready=2), reading(25, 1))
    assert d.rollout["phase"] == "Progressing"  # pause 60 s (default) still running
    d = w.step(T0 + 121, observed(canary_rev=NEW.revision, canary_ready=2), reading(40, 2))
    assert d.rollout["phase"] == "Promoting"
    assert d.stable_spec_json == NEW.spec_json and d.stable_replicas == 4
    assert d.canary_replicas == 2, "the canary serves until the stable side has rolled"
    d = w.step(
        T0 + 130, observed(stable_rev=NEW.revision, stable_done=False, canary_rev=NEW.revision)
    )
    assert d.rollout["phase"] == "Promoting"
    d = w.step(T0 + 150, observed(stable_rev=NEW.revision, canary_rev=NEW.revision))
    assert d.rollout["phase"] == "Complete" and d.canary_replicas == 0
    assert d.rollout["stableRevision"] == NEW.revision
    assert d.rollout["stableSpec"] == NEW.spec_json
    assert [r["outcome"] for r in w.revisions] == ["Succeeded", "Succeeded"]
    assert w.revisions[-1]["digest"] == "sha256:2" and w.revisions[-1]["finishedAt"]
    reasons = [e[1] for e in w.events]
    assert reasons == [
        "RolloutStarted",
        "StepPassed",
        "StepPassed",
        "Promoting",
        "RolloutComplete",
    ]
    # Settled: the next reconcile changes nothing and posts nothing.
    d2 = w.step(T0 + 160, observed(stable_rev=NEW.revision))
    assert d2.rollout == d.rollout and not d2.events and d2.settled


def test_a_canary_over_the_error_threshold_rolls_back_and_stays_back() -> None:
    w = World(canary_spec())
    w.step(T0, observed())
    w.step(T0 + 10, observed(canary_rev=NEW.revision, canary_ready=1), reading(4, 4))
    assert w.old["phase"] == "Progressing", "below minRequests nothing is judged"
    d = w.step(T0 + 15, observed(canary_rev=NEW.revision, canary_ready=1), reading(20, 6))
    assert d.rollout["phase"] == "RolledBack"
    assert (d.canary_replicas, d.stable_replicas, d.stable_spec_json) == (0, 4, OLD.spec_json)
    assert d.failed == "RolledBack"
    assert (d.rollout["analysis"]["requests"], d.rollout["analysis"]["errors"]) == (20, 6)
    assert d.condition[:2] == ("False", "RolledBack")
    assert "error ratio 0.300 > 0.1 over 20 requests" in d.condition[2]
    kind, reason, message = w.events[-1]
    assert (kind, reason) == ("Warning", "RolledBack") and "rolled back to aaaaaaaaaa" in message
    record = w.revisions[-1]
    assert (record["revision"], record["outcome"], record["reason"]) == (
        NEW.revision,
        "RolledBack",
        "AnalysisFailed",
    )
    # The failed target is not retried until the spec changes.
    d = w.step(T0 + 100, observed())
    assert d.rollout["phase"] == "RolledBack" and d.canary_replicas == 0 and not d.events
    newer = replace(NEW, revision="cccccccccc", spec_json='{"v":3}')
    d = w.step(T0 + 200, observed(), target=newer)
    assert d.rollout["phase"] == "Progressing" and d.canary_replicas == 1
    assert w.revisions[-1]["revision"] == "cccccccccc"


def test_p95_time_to_first_token_gate() -> None:
    w = World(canary_spec(maxTtftP95Seconds=0.5))
    w.step(T0, observed())
    slow = {0.1: 2.0, 0.5: 10.0, 1.0: 19.0, 2.5: 20.0, float("inf"): 20.0}
    d = w.step(T0 + 10, observed(canary_rev=NEW.revision, canary_ready=1), reading(20, 0, slow))
    assert d.rollout["phase"] == "RolledBack"
    assert "p95 time to first token 1 s > 0.5 s" in d.condition[2]


def test_a_canary_that_never_gets_ready_misses_the_deadline() -> None:
    w = World(canary_spec())
    w.step(T0, observed())
    d = w.step(T0 + 60, observed(canary_rev=NEW.revision, canary_ready=0))
    assert d.rollout["phase"] == "Progressing"
    d = w.step(T0 + 121, observed(canary_rev=NEW.revision, canary_ready=0))
    assert d.rollout["phase"] == "RolledBack"
    assert w.revisions[-1]["reason"] == "ProgressDeadlineExceeded"


def test_no_traffic_is_inconclusive_and_rolls_back() -> None:
    w = World(canary_spec())
    w.step(T0, observed())
    w.step(T0 + 5, observed(canary_rev=NEW.revision, canary_ready=1), reading(0, 0))
    d = w.step(T0 + 151, observed(canary_rev=NEW.revision, canary_ready=1), reading(2, 0))
    assert d.rollout["phase"] == "RolledBack"
    assert w.revisions[-1]["reason"] == "AnalysisInconclusive"


def test_without_auto_rollback_the_canary_is_held_for_a_person() -> None:
    spec = canary_spec().model_copy(update={"auto_rollback": False})
    w = World(spec)
    w.step(T0, observed())
    d = w.step(T0 + 10, observed(canary_rev=NEW.revision, canary_ready=1), reading(20, 20))
    assert d.rollout["phase"] == "Failed" and d.failed == "RolloutFailed"
    assert (d.canary_replicas, d.stable_replicas) == (1, 3)
    assert w.revisions[-1]["outcome"] == "Progressing"
    assert w.revisions[-1]["reason"] == "AnalysisFailed"


def test_pause_holds_the_step_and_resume_restarts_its_clock() -> None:
    w = World(canary_spec())
    w.step(T0, observed())
    w.step(T0 + 5, observed(canary_rev=NEW.revision, canary_ready=1), reading(50, 0))
    w.spec = w.spec.model_copy(update={"paused": True})
    d = w.step(T0 + 40, observed(canary_rev=NEW.revision, canary_ready=1), reading(60, 0))
    assert d.rollout["phase"] == "Paused" and d.rollout["step"] == 0
    assert d.condition[0] == "Unknown" and w.events[-1][1] == "Paused"
    d = w.step(T0 + 900, observed(canary_rev=NEW.revision, canary_ready=1), reading(60, 0))
    assert d.rollout["phase"] == "Paused" and w.events[-1][1] == "Paused"
    assert sum(1 for e in w.events if e[1] == "Paused") == 1
    w.spec = w.spec.model_copy(update={"paused": False})
    d = w.step(T0 + 901, observed(canary_rev=NEW.revision, canary_ready=1), reading(60, 0))
    assert d.rollout["phase"] == "Progressing" and d.rollout["step"] == 0
    assert w.events[-1][1] == "Resumed"
    d = w.step(T0 + 932, observed(canary_rev=NEW.revision, canary_ready=1), reading(60, 0))
    assert d.rollout["step"] == 1


def test_reverting_the_spec_mid_canary_removes_the_canary() -> None:
    w = World(canary_spec())
    w.step(T0, observed())
    d = w.step(T0 + 5, observed(canary_rev=NEW.revision, canary_ready=1), target=OLD)
    assert d.rollout["phase"] == "Complete" and d.canary_replicas == 0
    assert w.revisions[-1]["outcome"] == "Superseded"
    assert w.events[-1][1] == "RolloutAborted"


def test_rolling_update_completes_or_rolls_back_at_its_deadline() -> None:
    spec = RolloutSpec.model_validate({"progressDeadlineSeconds": 60})
    w = World(spec)
    d = w.step(T0, observed())
    assert d.stable_spec_json == NEW.spec_json and d.canary_replicas == 0
    assert d.condition[:2] == ("True", "RollingUpdate")
    d = w.step(T0 + 30, observed(stable_rev=NEW.revision, stable_done=True))
    assert d.rollout["phase"] == "Complete" and w.revisions[-1]["outcome"] == "Succeeded"

    w = World(spec)
    w.step(T0, observed())
    d = w.step(T0 + 30, observed(stable_rev=NEW.revision, stable_done=False, deadline=True))
    assert d.rollout["phase"] == "RolledBack" and d.stable_spec_json == OLD.spec_json
    assert w.revisions[-1]["reason"] == "ProgressDeadlineExceeded"


def test_rolling_pause_pauses_the_deployment() -> None:
    w = World(RolloutSpec.model_validate({"paused": True}))
    d = w.step(T0, observed())
    assert d.stable_paused and d.rollout["phase"] == "Paused"
    w.spec = RolloutSpec()
    d = w.step(T0 + 5, observed(stable_rev=NEW.revision, stable_done=False))
    assert not d.stable_paused and d.rollout["phase"] == "Progressing"


def test_first_revision_becomes_stable_when_ready() -> None:
    w = World(canary_spec())
    w.old, w.revisions = {}, []
    d = w.step(T0, observed(stable_rev=None, stable_done=False), target=OLD)
    assert d.rollout["phase"] == "Progressing" and d.canary_replicas == 0
    d = w.step(T0 + 5, observed(stable_rev=OLD.revision), target=OLD)
    assert d.rollout["phase"] == "Complete" and d.rollout["stableSpec"] == OLD.spec_json
    assert [r["outcome"] for r in w.revisions] == ["Succeeded"]


def test_history_is_bounded() -> None:
    w = World(RolloutSpec())
    for i in range(15):
        target = replace(NEW, revision=f"r{i:09d}", spec_json=f'{{"v":{i}}}')
        w.step(T0 + i * 10, observed(), target=target)
        w.step(T0 + i * 10 + 5, observed(stable_rev=target.revision), target=target)
    assert len(w.revisions) == 10
    assert w.revisions[-1]["revision"] == "r000000014"
