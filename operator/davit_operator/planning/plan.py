"""The plan of one InferenceService: spec + catalog (+ node facts) -> Plan. No I/O, no clock,
no randomness.

`make_plan` either returns a complete `Plan` or raises `PlanError` naming the spec field at
fault, its value and what would work instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.catalog.loader import Catalog, Health
from davit_operator.planning.args import ENGINE_PORT, EngineInvocation, engine_invocation
from davit_operator.planning.args import served_name as _served_name
from davit_operator.planning.capabilities import (
    check_capabilities,
    tensor_limit,
    with_alternatives,
)
from davit_operator.planning.errors import PlanError
from davit_operator.planning.image import ResolvedImage, resolve_image
from davit_operator.planning.memory import (
    MemoryPlan,
    ShapeCatalog,
    estimate_plan,
    explicit_plan,
    identity_hash,
    load_shape_catalog,
    preflight,
    profile_identity,
    shape_for,
    with_memory,
)
from davit_operator.planning.placement import Fit, NodeFacts, Placement, check_fit, plan_placement
from davit_operator.planning.precision import check_fp8_accelerator, check_fp8_checkpoint
from davit_operator.planning.runner import SelectedRunner, select_runner


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
    memory: MemoryPlan | None = None

    @property
    def service_url(self) -> str:
        return f"http://{self.name}.{self.namespace}.svc:{self.port}/v1"


@cache
def default_shapes() -> ShapeCatalog:
    """The packaged shape catalog, read on first use."""
    return load_shape_catalog()


def make_plan(
    name: str,
    namespace: str,
    spec: InferenceServiceSpec,
    catalog: Catalog,
    nodes: list[NodeFacts] | None = None,
    shapes: ShapeCatalog | None = None,
) -> Plan:
    """Turn a spec into a plan; `nodes` (when known) feed the pre-flight fit check, `shapes`
    (default: the packaged catalog) the memory check, which raises PlanError when the model
    cannot fit on the accelerator. A spec asking for more than the engine release implements
    (catalog `capabilities`) is refused before the runner is chosen."""
    image = resolve_image(spec, catalog)
    check_capabilities(spec, catalog)
    check_fp8_accelerator(spec, catalog)
    check_fp8_checkpoint(spec, catalog, shape_for(spec, shapes or default_shapes()))
    try:
        runner = select_runner(spec, catalog, image.variant)
    except PlanError as refused:
        raise with_alternatives(refused, spec, catalog) from None
    speculative = spec.features.speculative
    if speculative is not None and speculative.verification == "FLy":
        # A lossy policy is never silent: the RunnerSelected condition says so.
        runner = replace(
            runner,
            reason=f"{runner.reason}; speculative decoding ({speculative.method}, "
            f"{speculative.num_speculative_tokens} tokens) with FLy verification: lossy, the "
            "output may differ from the model's own",
        )
    engine = catalog.engines.engines[spec.engine.type]
    release = engine.facts_for(image.engine_version)
    assert release is not None
    invocation = engine_invocation(spec, engine, release, runner)
    placement = plan_placement(spec, catalog)
    estimate = preflight(
        spec, shapes or default_shapes(), spec.accelerator.product, tensor_limit(spec, catalog)
    )
    plan = Plan(
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
    identity = identity_hash(profile_identity(plan))
    if spec.limits.kv_cache_memory_bytes is not None:
        memory = explicit_plan(
            spec.limits.kv_cache_memory_bytes, estimate, identity, spec.limits.max_model_len
        )
        return with_memory(plan, memory)
    if estimate is not None:
        return with_memory(plan, estimate_plan(estimate, identity, "estimate"))
    return plan
