"""Resources and node placement per accelerator vendor, and the pre-flight fit check.

The fit check compares one replica's requests with the allocatable resources of the nodes the
operator knows about; it answers "no node can ever run a replica" (a spec that is valid but
impossible here), not "is there room right now" (the scheduler's job).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.catalog.loader import Catalog
from davit_operator.planning.offload import cpu_bytes

# Per accelerator (or per replica on CPU): enough for tokenization, the HTTP front end and
# loading weights; users raise them through pod.resources.
CPU_PER_GPU = 4
MEMORY_GIB_PER_GPU = 32
CPU_ONLY_CPU = 4
CPU_ONLY_MEMORY_GIB = 16


@dataclass(frozen=True)
class NodeFacts:
    """What the fit check needs to know about a node."""

    name: str
    labels: dict[str, str]
    allocatable: dict[str, str]
    unschedulable: bool = False
    taints: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True)
class Placement:
    resources: dict[str, dict[str, str]]
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    affinity: dict[str, Any] | None
    accelerator_resource: str | None
    accelerator_count: int
    summary: str


@dataclass(frozen=True)
class Fit:
    """`fits` is None when no node information is available."""

    fits: bool | None
    message: str


def accelerator_count(spec: InferenceServiceSpec) -> int:
    """GPUs per replica: accelerator.count, else tensor x pipeline x data (0 on CPU)."""
    if spec.accelerator.vendor == "cpu":
        return 0
    if spec.accelerator.count is not None:
        return spec.accelerator.count
    p = spec.parallelism
    return p.tensor * p.pipeline * p.data


def _quantity(value: int | str) -> str:
    return str(value)


def plan_placement(spec: InferenceServiceSpec, catalog: Catalog) -> Placement:
    vendor = catalog.accelerators.vendors[spec.accelerator.vendor]
    count = accelerator_count(spec)
    if vendor.resource is not None:
        requests = {"cpu": str(CPU_PER_GPU * count), "memory": f"{MEMORY_GIB_PER_GPU * count}Gi"}
    else:
        requests = {"cpu": str(CPU_ONLY_CPU), "memory": f"{CPU_ONLY_MEMORY_GIB}Gi"}
    requests.update({k: _quantity(v) for k, v in spec.pod.resources.requests.items()})
    limits = {k: _quantity(v) for k, v in spec.pod.resources.limits.items()}
    # The KV offload CPU tier is host memory on top of everything else (a set limit too).
    offload = cpu_bytes(spec)
    if offload:
        requests["memory"] = str(int(parse_quantity(requests["memory"])) + offload)
        if "memory" in limits:
            limits["memory"] = str(int(parse_quantity(limits["memory"])) + offload)
    if vendor.resource is not None:
        # Extended resources are requested through limits; the API server copies them.
        limits[vendor.resource] = str(count)
        requests.pop(vendor.resource, None)
    resources = {"requests": dict(sorted(requests.items()))}
    if limits:
        resources["limits"] = dict(sorted(limits.items()))

    node_selector: dict[str, str] = {}
    if spec.accelerator.product and vendor.product_label:
        node_selector[vendor.product_label] = spec.accelerator.product
    node_selector.update(spec.pod.node_selector)

    tolerations = [dict(t) for t in vendor.tolerations]
    tolerations += [t.model_dump(by_alias=True, exclude_none=True) for t in spec.pod.tolerations]

    affinity: dict[str, Any] | None = None
    if vendor.resource is None:
        # Keep CPU-only replicas off accelerator nodes when a CPU node has room.
        markers = sorted(
            info.node_marker_label
            for info in catalog.accelerators.vendors.values()
            if info.node_marker_label
        )
        affinity = {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "preference": {
                            "matchExpressions": [
                                {"key": key, "operator": "DoesNotExist"} for key in markers
                            ]
                        },
                    }
                ]
            }
        }
    product = spec.accelerator.product or spec.accelerator.vendor
    summary = "cpu" if vendor.resource is None else f"{count}x {product}"
    return Placement(
        resources=resources,
        node_selector=node_selector,
        tolerations=tolerations,
        affinity=affinity,
        accelerator_resource=vendor.resource,
        accelerator_count=count,
        summary=summary,
    )


def _amount(quantities: dict[str, str], name: str) -> Decimal:
    raw = quantities.get(name)
    return parse_quantity(raw) if raw is not None else Decimal(0)


def _tolerates(toleration: dict[str, Any], taint: dict[str, str]) -> bool:
    effect = toleration.get("effect")
    if effect and effect != taint.get("effect"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return not toleration.get("key") or toleration.get("key") == taint.get("key")
    return bool(
        toleration.get("key") == taint.get("key")
        and toleration.get("value", "") == taint.get("value", "")
    )


def _admits(node: NodeFacts, tolerations: list[dict[str, Any]]) -> bool:
    """Whether every scheduling-blocking taint of the node is tolerated."""
    return all(
        any(_tolerates(t, taint) for t in tolerations)
        for taint in node.taints
        if taint.get("effect") in ("NoSchedule", "NoExecute")
    )


def check_fit(placement: Placement, nodes: list[NodeFacts] | None) -> Fit:
    """Whether at least one known node could ever run one replica, with the reason if not."""
    if not nodes:
        return Fit(None, "no node information available")
    selected = [
        node
        for node in nodes
        if not node.unschedulable
        and all(node.labels.get(k) == v for k, v in placement.node_selector.items())
    ]
    admitted = [node for node in selected if _admits(node, placement.tolerations)]
    if selected and not admitted:
        taints = sorted(
            {
                f"{t.get('key')}={t.get('value', '')}:{t.get('effect')}"
                for n in selected
                for t in n.taints
            }
        )
        return Fit(
            False,
            f"every matching node has a taint the pods do not tolerate ({', '.join(taints)}); "
            "add pod.tolerations",
        )
    selected = admitted
    if not selected:
        wanted = ", ".join(f"{k}={v}" for k, v in placement.node_selector.items())
        offered = sorted(
            {
                f"{k}={node.labels[k]}"
                for node in nodes
                for k in placement.node_selector
                if k in node.labels
            }
        )
        return Fit(
            False,
            f"no schedulable node has the labels {wanted}"
            + (f"; nodes offer {', '.join(offered)}" if offered else "")
            + "; change accelerator.product or pod.nodeSelector",
        )
    wanted_amounts: dict[str, Decimal] = {}
    for section in ("requests", "limits"):
        for name, value in placement.resources.get(section, {}).items():
            wanted_amounts[name] = max(wanted_amounts.get(name, Decimal(0)), parse_quantity(value))
    best: tuple[str, Decimal] | None = None
    for node in selected:
        if all(_amount(node.allocatable, n) >= amount for n, amount in wanted_amounts.items()):
            return Fit(True, f"fits on node {node.name}")
    resource = placement.accelerator_resource
    if resource is not None:
        for node in selected:
            have = _amount(node.allocatable, resource)
            if best is None or have > best[1]:
                best = (node.name, have)
        assert best is not None
        if best[1] < wanted_amounts.get(resource, Decimal(0)):
            return Fit(
                False,
                f"one replica needs {placement.accelerator_count} {resource} but the largest "
                f"matching node offers {best[1]} ({best[0]}); lower parallelism or "
                "accelerator.count, or add larger nodes",
            )
    short = [
        f"{name} {amount}"
        for name, amount in sorted(wanted_amounts.items())
        if all(_amount(node.allocatable, name) < amount for node in selected)
    ]
    return Fit(
        False,
        "no matching node has enough allocatable resources for one replica ("
        + (", ".join(short) or "no single node has all of them at once")
        + "); lower pod.resources or add larger nodes",
    )
