"""Autoscaling end to end: real engines, a real metrics pipeline and the cluster's HPA controller.

The operator creates the HorizontalPodAutoscaler of `spec.autoscaling`; the local control plane's
kube-controller-manager runs it. Its Pods metric `vllm_num_requests_waiting` comes the way it
comes in a cluster: the engines (real `davit serve` processes of the engine kubelet stand-in)
count their queue on `/metrics`, Prometheus discovers the pods through the API server and scrapes
them, prometheus-adapter serves the series as `custom.metrics.k8s.io` through the API server's
aggregation layer (metrics_pipeline.py). Engines run one sequence at a time, so concurrent
requests queue; the HPA then writes the InferenceService's scale subresource, the operator
scales the Deployment, the stand-in starts engines. After the load the count returns to
`minReplicas` and the removed engines drain while a light load keeps flowing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from .conftest import E2E, base_spec, document
from .metrics_pipeline import (
    ADAPTER_VERSION,
    PROMETHEUS_VERSION,
    MetricsAdapter,
    Prometheus,
    binary,
)
from .traffic import Load, ServiceEndpoints
from .waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "auto"
WAITING_METRIC = "vllm_num_requests_waiting"
MIN_REPLICAS = 1
MAX_REPLICAS = 3
TARGET_WAITING = 2
SCALE_DOWN_STABILIZATION_S = 20
# One engine runs one sequence: with 8 clients, 7 wait (average 7 > target 2: the HPA asks for
# ceil(7 / 2) = 4, capped at 3); on 3 engines about 5 wait, 1.7 each, which keeps 3.
HEAVY_WORKERS = 8
PROMPT = "List five colours of the sea at dawn, one per line:"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def metrics_binaries() -> None:
    # Before the e2e fixture starts an operator: a machine without them skips at once.
    binary("prometheus", PROMETHEUS_VERSION, "prometheus")
    binary("prometheus-adapter", ADAPTER_VERSION, "adapter")


@pytest.fixture(scope="module")
def pipeline(metrics_binaries: None, e2e: E2E) -> Iterator[tuple[Prometheus, MetricsAdapter]]:
    prometheus = Prometheus(e2e.cluster, e2e.namespace, e2e.log_dir / "prometheus").start()
    adapter = MetricsAdapter(e2e.cluster, e2e.namespace, prometheus.url, e2e.log_dir / "adapter")
    try:
        adapter.start()
        yield prometheus, adapter
    finally:
        adapter.stop()
        prometheus.stop()


def wait_for(what: str, probe: Any, timeout: float, e2e: E2E) -> Any:
    return wait_until(what, probe, timeout, e2e.log_dir / "operator.log")


def has_hpa(e2e: E2E) -> bool:
    found = e2e.cluster.kubectl("get", "hpa", NAME, "-n", e2e.namespace, "-o", "name", check=False)
    return found.returncode == 0 and bool(found.stdout.strip())


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond["type"] == kind:
            return dict(cond)
    return {}


@dataclass
class Observation:
    """What the cluster shows at one moment: the count asked for and the engines serving."""

    at: float
    hpa_desired: int
    replicas: int  # InferenceService spec.replicas (written by the HPA through the scale API)
    ready_pods: int  # engine pods Ready and not terminating
    pods: int  # engine pods, terminating ones included
    waiting: dict[str, float] = field(default_factory=dict)  # per pod, from custom.metrics


def observe(e2e: E2E, adapter: MetricsAdapter, started: float) -> Observation:
    hpa = e2e.kubectl_json("get", "hpa", NAME)
    isvc = e2e.isvc(NAME)
    pods = e2e.kubectl_json("get", "pods", "-l", f"serving.davit.dev/inferenceservice={NAME}")
    ready = [
        p
        for p in pods["items"]
        if "deletionTimestamp" not in p["metadata"]
        and condition(p, "Ready").get("status") == "True"
    ]
    return Observation(
        at=time.monotonic() - started,
        hpa_desired=int(hpa.get("status", {}).get("desiredReplicas") or 0),
        replicas=int(isvc["spec"]["replicas"]),
        ready_pods=len(ready),
        pods=len(pods["items"]),
        waiting=adapter.pods_metric(e2e.namespace, WAITING_METRIC),
    )


class Timeline:
    """Observations polled while waiting, with the first moment each condition held."""

    def __init__(self, e2e: E2E, adapter: MetricsAdapter) -> None:
        self.e2e, self.adapter = e2e, adapter
        self.started = time.monotonic()
        self.seen: list[Observation] = []

    def until(self, what: str, done: Any, timeout: float) -> Observation:
        def probe() -> Observation | None:
            now = observe(self.e2e, self.adapter, self.started)
            self.seen.append(now)
            return now if done(now) else None

        result: Observation = wait_for(what, probe, timeout, self.e2e)
        return result

    def changes(self) -> list[str]:
        """One line per observation that differs from the one before it."""
        lines, last = [], None
        for o in self.seen:
            state = (o.hpa_desired, o.replicas, o.ready_pods, o.pods, sorted(o.waiting.values()))
            if state != last:
                waiting = [round(v, 1) for v in o.waiting.values()]
                lines.append(
                    f"{o.at:6.1f}: desired {o.hpa_desired}, replicas {o.replicas}, "
                    f"pods {o.ready_pods}/{o.pods}, waiting {waiting}"
                )
                last = state
        return lines

    def first(self, done: Any) -> Observation | None:
        return next((o for o in self.seen if done(o)), None)


def test_waiting_requests_scale_the_service_up_and_back_down(
    e2e: E2E, pipeline: tuple[Prometheus, MetricsAdapter]
) -> None:
    prometheus, adapter = pipeline
    spec = base_spec(MIN_REPLICAS, {"strategy": "Rolling", "drainSeconds": 15})
    spec["limits"]["maxNumSeqs"] = 1
    # Three engines share two cores here: one thread each keeps a busy engine from starving the
    # ones starting beside it.
    spec["pod"]["env"] = [{"name": "OMP_NUM_THREADS", "value": "1"}]
    spec["autoscaling"] = {
        "minReplicas": MIN_REPLICAS,
        "maxReplicas": MAX_REPLICAS,
        "signal": "WaitingRequests",
        "targetWaitingRequests": TARGET_WAITING,
        "scaleDownStabilizationSeconds": SCALE_DOWN_STABILIZATION_S,
    }
    e2e.apply(document(NAME, spec))
    setup = time.monotonic()

    # The pipeline carries the idle engine's zero before any load: Prometheus found the pod
    # through the API server, the adapter serves it, the HPA controller read it.
    def hpa_reads_metrics() -> dict[str, Any] | None:
        if not has_hpa(e2e):
            return None
        hpa: dict[str, Any] = e2e.kubectl_json("get", "hpa", NAME)
        return hpa if condition(hpa, "ScalingActive").get("status") == "True" else None

    hpa = wait_for("the HPA reads vllm_num_requests_waiting", hpa_reads_metrics, 300, e2e)
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "InferenceService"
    idle = adapter.pods_metric(e2e.namespace, WAITING_METRIC)
    assert len(idle) == 1 and list(idle.values()) == [0.0], idle
    targets = prometheus.active_targets()
    assert [t["health"] for t in targets] == ["up"], targets
    assert targets[0]["scrapeUrl"].startswith("http://127.65."), targets[0]["scrapeUrl"]
    metrics_ready_s = time.monotonic() - setup
    # The engine serves /metrics (zeros) while it loads; the load starts once it answers.
    wait_for(
        "the first engine Ready",
        lambda: condition(e2e.isvc(NAME), "Ready").get("status") == "True",
        300,
        e2e,
    )
    first_ready_s = time.monotonic() - setup

    endpoints = ServiceEndpoints(e2e.cluster.kubeconfig, e2e.namespace, NAME, 8000).start()
    heavy = Load(
        endpoints, "smol", PROMPT, max_tokens=MAX_TOKENS, workers=HEAVY_WORKERS, timeout_s=300
    ).start()
    light: Load | None = None
    timeline = Timeline(e2e, adapter)
    try:
        up = timeline.until(
            f"{MAX_REPLICAS} engines Ready under load",
            lambda o: o.replicas == MAX_REPLICAS and o.ready_pods == MAX_REPLICAS,
            480,
        )
        # The added engines take their share of the load: each one has run a request (its
        # own vllm:num_requests_running, through Prometheus).
        busy = f'max_over_time(vllm:num_requests_running{{namespace="{e2e.namespace}"}}[10m])'

        def every_engine_ran_a_request() -> bool:
            ran = {r["metric"]["pod"] for r in prometheus.query(busy) if float(r["value"][1]) >= 1}
            return len(ran) >= MAX_REPLICAS

        wait_for("every engine ran requests", every_engine_ran_a_request, 240, e2e)
        at_max = time.monotonic() - timeline.started
        heavy.stop()
        load_stopped = time.monotonic() - timeline.started
        # A light load keeps requests flowing while the HPA removes replicas: every one that an
        # engine accepted must be answered (the removed engines drain).
        light = Load(endpoints, "smol", PROMPT, max_tokens=MAX_TOKENS, workers=1, timeout_s=300)
        light.start()
        down = timeline.until(
            f"back to {MIN_REPLICAS} engine after the load",
            lambda o: o.at > load_stopped and o.replicas == MIN_REPLICAS and o.pods == MIN_REPLICAS,
            420,
        )
        ok_after = light.tally.ok
        wait_for("answers after the scale-down", lambda: light.tally.ok >= ok_after + 2, 120, e2e)
        hpa = e2e.kubectl_json("get", "hpa", NAME)
    finally:
        heavy_tally = heavy.stop()
        light_tally = light.stop() if light is not None else None
        endpoints.stop()
        e2e.cluster.kubectl("delete", "infsvc", NAME, "-n", e2e.namespace, "--wait=false")

    assert heavy_tally.failed == [], heavy_tally.failed
    assert light_tally is not None and light_tally.failed == [], light_tally.failed
    # The queue was seen through the pipeline, and it drove the count.
    peak_waiting = max(sum(o.waiting.values()) for o in timeline.seen)
    assert peak_waiting >= TARGET_WAITING, peak_waiting
    first_desired = timeline.first(lambda o: o.hpa_desired > MIN_REPLICAS)
    first_scaled = timeline.first(lambda o: o.replicas > MIN_REPLICAS)
    assert first_desired is not None and first_scaled is not None
    after_load = [o for o in timeline.seen if o.at > load_stopped]
    first_down = next(o for o in after_load if o.replicas == MIN_REPLICAS)
    # Never above the range, never below it.
    assert max(o.replicas for o in timeline.seen) == MAX_REPLICAS
    assert min(o.replicas for o in timeline.seen) >= MIN_REPLICAS
    # The removed engines drained: SIGTERM and exit 0, none killed at the grace period.
    removed = [t for t in e2e.kubelet.terminated if t[0].startswith(f"{e2e.namespace}/{NAME}-")]
    assert len(removed) >= MAX_REPLICAS - MIN_REPLICAS, removed
    assert all(code == 0 for _, code, _ in removed), removed
    print(
        f"\nautoscaling e2e (min {MIN_REPLICAS}, max {MAX_REPLICAS}, target "
        f"{TARGET_WAITING} waiting, scale-down stabilization {SCALE_DOWN_STABILIZATION_S} s, "
        f"{HEAVY_WORKERS} clients on max-num-seqs 1 engines):\n"
        f"  apply -> HPA ScalingActive (the loading engine's zeros): {metrics_ready_s:.0f} s; "
        f"-> first engine Ready: {first_ready_s:.0f} s\n"
        f"  load start -> HPA desired {first_desired.hpa_desired}: {first_desired.at:.0f} s; "
        f"-> spec.replicas {first_scaled.replicas}: {first_scaled.at:.0f} s; "
        f"-> {up.ready_pods} engines Ready: {up.at:.0f} s; -> each ran requests: {at_max:.0f} s\n"
        f"  peak waiting seen through custom.metrics: {peak_waiting:.0f} "
        f"(per pod at the peak: {max(timeline.seen, key=lambda o: sum(o.waiting.values())).waiting})\n"
        f"  load stop -> spec.replicas {MIN_REPLICAS}: {first_down.at - load_stopped:.0f} s; "
        f"-> {MIN_REPLICAS} engine pod left: {down.at - load_stopped:.0f} s\n"
        f"  heavy load: {heavy_tally.ok} ok, {heavy_tally.not_admitted} not admitted (retried), "
        f"{len(heavy_tally.failed)} failed; light load during scale-down: {light_tally.ok} ok, "
        f"{light_tally.not_admitted} not admitted, {len(light_tally.failed)} failed\n"
        f"  removed engines drained in {[round(t[2], 1) for t in removed]} s (exit codes "
        f"{[t[1] for t in removed]}); HPA status {hpa.get('status', {}).get('currentMetrics')}\n"
        f"  timeline (s after load start: HPA desired, spec.replicas, Ready/all engine pods, "
        f"waiting per pod):\n    " + "\n    ".join(timeline.changes())
    )
