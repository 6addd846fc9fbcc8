"""Rollouts end to end: the operator, the local control plane and real engine processes.

The engine kubelet stand-in (kubelet.py) runs `davit serve` (CPU, SmolLM2 GGUF) for every pod,
gates readiness on the engine's own `/ready`, and terminates pods the way a kubelet does
(pre-stop sleep, SIGTERM, grace period), so the operator's canary analysis reads real metrics
from real engines and the drain really happens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from .conftest import E2E, base_spec, document
from .traffic import Load, ServiceEndpoints
from .waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# About 40 tokens: more than a 32-token context holds together with the completion.
PROMPT = (
    "Write one short sentence about the sea, the wind and the boats that leave the old harbour "
    "every morning before the sun rises over the hills behind the quiet town:"
)


def wait_for(what: str, probe: Callable[[], Any], timeout: float, e2e: E2E) -> Any:
    return wait_until(what, probe, timeout, e2e.log_dir / "operator.log")


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond["type"] == kind:
            return dict(cond)
    return {}


def rollout(obj: dict[str, Any]) -> dict[str, Any]:
    return dict(obj.get("status", {}).get("rollout") or {})


def wait_complete(e2e: E2E, name: str, timeout: float, not_revision: str | None = None) -> Any:
    def probe() -> dict[str, Any] | None:
        obj = e2e.isvc(name)
        r = rollout(obj)
        done = (
            r.get("phase") == "Complete"
            and r.get("stableRevision") != not_revision
            and condition(obj, "Ready").get("status") == "True"
            and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
        )
        return obj if done else None

    return wait_for(f"{name} rollout complete", probe, timeout, e2e)


def test_rolling_update_under_load_fails_no_admitted_request(e2e: E2E) -> None:
    spec = base_spec(
        2,
        {
            "strategy": "Rolling",
            "rolling": {"maxSurge": 1, "maxUnavailable": 0},
            "drainSeconds": 15,
            "progressDeadlineSeconds": 240,
        },
    )
    e2e.apply(document("roll", spec))
    first = wait_complete(e2e, "roll", 180)
    old_revision = rollout(first)["stableRevision"]
    endpoints = ServiceEndpoints(e2e.cluster.kubeconfig, e2e.namespace, "roll", 8000).start()
    load = Load(endpoints, "smol", PROMPT, max_tokens=6, workers=3).start()
    try:
        wait_for("traffic on the old revision", lambda: load.tally.ok >= 6, 60, e2e)
        spec["limits"]["maxNumSeqs"] = 16  # a new engine command line: a new revision
        e2e.apply(document("roll", spec))
        done = wait_complete(e2e, "roll", 300, not_revision=old_revision)
        # Keep the load on the new replicas for a moment.
        ok_before = load.tally.ok
        wait_for("traffic on the new revision", lambda: load.tally.ok >= ok_before + 6, 60, e2e)
    finally:
        tally = load.stop()
        endpoints.stop()
        # Free the machine for the next test: its engines drain and stop.
        e2e.cluster.kubectl("delete", "infsvc", "roll", "-n", e2e.namespace, "--wait=false")

    assert tally.failed == [], tally.failed
    hashes = {key.split("/")[1] for key in tally.by_track}
    assert len(hashes) == 2, f"answers came from one revision only: {tally.by_track}"
    assert tally.ok >= 12
    # Both old replicas were drained (SIGTERM, exit 0), none killed at the grace period.
    # (The Deployment counts a terminating replica as gone; its engine may still be draining.)
    prefix = f"{e2e.namespace}/roll-"
    old = wait_for(
        "both old replicas terminated",
        lambda: (
            [t for t in e2e.kubelet.terminated if t[0].startswith(prefix)][:2]
            if len([t for t in e2e.kubelet.terminated if t[0].startswith(prefix)]) >= 2
            else None
        ),
        60,
        e2e,
    )
    assert all(code == 0 for _, code, _ in old), old
    history = done["status"]["revisions"]
    assert [(r["revision"], r["outcome"]) for r in history] == [
        (old_revision, "Succeeded"),
        (rollout(done)["stableRevision"], "Succeeded"),
    ]
    assert "--max-num-seqs" in history[-1]["engineArgs"]
    assert "--drain-timeout" in history[-1]["engineArgs"]
    reasons = [e["reason"] for e in e2e.events("roll")]
    assert "RolloutStarted" in reasons and "RolloutComplete" in reasons
    print(
        f"\nrolling update, 2 replicas, maxSurge 1: {tally.ok} ok, {tally.not_admitted} not "
        f"admitted (retried), 0 failed; answers per replica set {dict(tally.by_track)}; "
        f"old replicas drained in {[round(t[2], 1) for t in old]} s"
    )


def test_canary_rolls_back_a_failing_revision_and_promotes_a_good_one(e2e: E2E) -> None:
    spec = base_spec(
        1,
        {
            "strategy": "Canary",
            "canary": {
                "steps": [{"weight": 50, "pauseSeconds": 6}, {"weight": 100, "pauseSeconds": 6}]
            },
            "analysis": {
                "maxErrorRatio": 0.2,
                "maxTtftP95Seconds": 30,
                "minRequests": 6,
                "intervalSeconds": 2,
            },
            "drainSeconds": 10,
            "progressDeadlineSeconds": 180,
        },
    )
    e2e.apply(document("canary", spec))
    first = wait_complete(e2e, "canary", 180)
    good_revision = rollout(first)["stableRevision"]
    endpoints = ServiceEndpoints(e2e.cluster.kubeconfig, e2e.namespace, "canary", 8000).start()
    load = Load(endpoints, "smol", PROMPT, max_tokens=6, workers=3).start()
    try:
        wait_for("traffic on the stable revision", lambda: load.tally.ok >= 4, 60, e2e)

        # A revision whose context is too short for the load's prompts: every request it
        # admits is refused with 400, counted by its engine's http_requests_total.
        spec["limits"]["maxModelLen"] = 32
        e2e.apply(document("canary", spec))

        def rolled_back() -> dict[str, Any] | None:
            obj = e2e.isvc("canary")
            return obj if rollout(obj).get("phase") == "RolledBack" else None

        back = wait_for("automatic rollback", rolled_back, 240, e2e)
        bad = load.stop()
        load = Load(endpoints, "smol", PROMPT, max_tokens=6, workers=3).start()

        r = rollout(back)
        assert r["stableRevision"] == good_revision
        assert r["analysis"]["errors"] >= 6 and r["analysis"]["errorRatio"] > 0.2
        cond = condition(back, "RolloutProgressing")
        assert (cond["status"], cond["reason"]) == ("False", "RolledBack")
        assert "AnalysisFailed" in cond["message"] and "error ratio" in cond["message"]
        stalled = condition(back, "Stalled")
        assert (stalled["status"], stalled["reason"]) == ("True", "RolledBack")
        record = back["status"]["revisions"][-1]
        assert (record["outcome"], record["reason"]) == ("RolledBack", "AnalysisFailed")
        assert "--max-model-len" in record["engineArgs"]
        warnings = [e for e in e2e.events("canary") if e["reason"] == "RolledBack"]
        assert warnings and warnings[-1]["type"] == "Warning"
        # The canary Deployment goes; the stable one keeps its replica.
        wait_for(
            "canary Deployment removed",
            lambda: (
                not e2e.kubectl_json("get", "deployments", "-l", "serving.davit.dev/track=canary")[
                    "items"
                ]
            ),
            60,
            e2e,
        )
        # Every failure came from the canary, none from the stable replica.
        assert bad.failed and all("(canary/" in f for f in bad.failed), bad.failed
        assert all(" 400 " in f for f in bad.failed), bad.failed[:3]

        # A good revision passes both steps and becomes stable.
        spec["limits"]["maxModelLen"] = 2048
        e2e.apply(document("canary", spec))
        done = wait_complete(e2e, "canary", 300, not_revision=good_revision)
        ok_before = load.tally.ok
        wait_for(
            "traffic on the promoted revision", lambda: load.tally.ok >= ok_before + 4, 60, e2e
        )
    finally:
        good = load.stop()
        endpoints.stop()

    assert good.failed == [], good.failed
    assert any(k.startswith("canary/") for k in good.by_track), good.by_track
    history = [(r["outcome"], r.get("reason")) for r in done["status"]["revisions"]]
    assert history == [
        ("Succeeded", "Available"),
        ("RolledBack", "AnalysisFailed"),
        ("Succeeded", "Promoted"),
    ]
    assert condition(done, "Stalled")["status"] == "False"
    assert condition(done, "RolloutProgressing")["reason"] == "Complete"
    reasons = [e["reason"] for e in e2e.events("canary")]
    assert reasons.count("StepPassed") == 2, reasons
    assert "Promoting" in reasons and "RolloutComplete" in reasons
    print(
        f"\ncanary 50% -> 100%: bad revision rolled back after {back['status']['rollout']['analysis']}"
        f"; good revision promoted with {good.ok} ok, {good.not_admitted} not admitted, 0 failed"
    )
