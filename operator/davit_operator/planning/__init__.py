"""Pure planning: spec + catalog (+ node facts) -> Plan. No I/O, no clock, no randomness.

`make_plan` either returns a complete `Plan` or raises `PlanError` naming the spec field at
fault, its value and what would work instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.catalog import Catalog, Health
from davit_operator.planning.args import ENGINE_PORT, EngineInvocation, engine_invocation
from davit_operator.planning.args import served_name as _served_name
from davit_operator.planning.errors import PlanError
from davit_operator.planning.image import ResolvedImage, resolve_image
from davit_operator.planning.placement import Fit, NodeFacts, Placement, check_fit, plan_placement
from davit_operator.planning.runner import SelectedRunner, select_runner

__all__ = [
    "ENGINE_PORT",
    "Fit",
    "NodeFacts",
    "Plan",
    "PlanError",
    "make_plan",
]


@dataclass(frozen=True)
class Plan:
    """Everything the builders and the status need, decided once per reconcile."""

    name: str
    namespace: str
    spec: InferenceServiceSpec
    image: ResolvedImage
    runner: SelectedRunner
    invocation: EngineInvocation
    health: Health
    placement: Placement
    fit: Fit
    served_name: str
    replicas: int
    port: int = ENGINE_PORT

    @property
    def service_url(self) -> str:
        return f"http://{self.name}.{self.namespace}.svc:{self.port}/v1"


def make_plan(
    name: str,
    namespace: str,
    spec: InferenceServiceSpec,
    catalog: Catalog,
    nodes: list[NodeFacts] | None = None,
) -> Plan:
    """Turn a spec into a plan; `nodes` (when known) feed the pre-flight fit check."""
    image = resolve_image(spec, catalog)
    runner = select_runner(spec, catalog, image.variant)
    engine = catalog.engines.engines[spec.engine.type]
    release = engine.release(image.engine_version)
    assert release is not None
    invocation = engine_invocation(spec, engine, runner, len(release.runners))
    placement = plan_placement(spec, catalog)
    return Plan(
        name=name,
        namespace=namespace,
        spec=spec,
        image=image,
        runner=runner,
        invocation=invocation,
        health=engine.health,
        placement=placement,
        fit=check_fit(placement, nodes),
        served_name=_served_name(spec),
        replicas=spec.replicas,
    )
