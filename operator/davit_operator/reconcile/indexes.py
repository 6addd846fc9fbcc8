"""The kopf indexes a reconcile reads instead of the API server, typed.

Children (Deployments, Services, PodDisruptionBudgets, HorizontalPodAutoscalers, InferencePools
and HTTPRoutes) are indexed by the InferenceService they
belong to, `(namespace, name)`, from their instance label; nodes by name. Values are compact
copies of the watched objects (`watched`) and `NodeFacts` (`node_facts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from davit_operator.planning.placement import NodeFacts

KubeObject = dict[str, Any]
ObjectKey = tuple[str | None, str]  # (namespace, InferenceService name)


def watched(body: kopf.Body) -> KubeObject:
    """A compact copy of a watched object: managedFields are large and never needed."""
    obj = {"metadata": dict(body.metadata), "spec": dict(body.spec), "status": dict(body.status)}
    obj["metadata"].pop("managedFields", None)
    return obj


def node_facts(name: str, body: kopf.Body) -> NodeFacts:
    """What placement reads of a Node."""
    return NodeFacts(
        name=name,
        labels=dict(body.metadata.labels),
        allocatable=dict(body.status.get("allocatable") or {}),
        unschedulable=bool(body.spec.get("unschedulable", False)),
        taints=tuple(dict(t) for t in body.spec.get("taints") or ()),
    )


def _no_index() -> kopf.Index[ObjectKey, KubeObject]:
    """An index with nothing in it (a kind no test or handler indexes)."""
    return cast("kopf.Index[ObjectKey, KubeObject]", {})


@dataclass(frozen=True)
class Indexes:
    deployments: kopf.Index[ObjectKey, KubeObject]
    services: kopf.Index[ObjectKey, KubeObject]
    budgets: kopf.Index[ObjectKey, KubeObject]
    nodes: kopf.Index[str, NodeFacts]
    # Empty where the kind is not served (the InferencePool and HTTPRoute CRDs are optional).
    autoscalers: kopf.Index[ObjectKey, KubeObject] = field(default_factory=_no_index)
    pools: kopf.Index[ObjectKey, KubeObject] = field(default_factory=_no_index)
    routes: kopf.Index[ObjectKey, KubeObject] = field(default_factory=_no_index)

    def children(self, kind: str) -> kopf.Index[ObjectKey, KubeObject]:
        """The index of a child kind the operator applies."""
        by_kind = {
            "Deployment": self.deployments,
            "Service": self.services,
            "PodDisruptionBudget": self.budgets,
            "HorizontalPodAutoscaler": self.autoscalers,
            "InferencePool": self.pools,
            "HTTPRoute": self.routes,
        }
        return by_kind[kind]

    def named(self, kind: str, key: ObjectKey, name: str) -> KubeObject | None:
        """The indexed child of `kind` under `key` with this metadata.name."""
        for value in self.children(kind).get(key) or ():
            if value["metadata"]["name"] == name:
                return value
        return None

    def first(self, kind: str, key: ObjectKey) -> KubeObject | None:
        """Any indexed child of `kind` under `key`."""
        for value in self.children(kind).get(key) or ():
            return value
        return None

    def deployments_by_name(self, key: ObjectKey) -> dict[str, KubeObject]:
        return {d["metadata"]["name"]: d for d in self.deployments.get(key) or ()}

    def node_list(self) -> list[NodeFacts]:
        """Every indexed node, by name."""
        found: list[NodeFacts] = []
        for name in self.nodes:
            for node in self.nodes.get(name) or ():
                found.append(node)
                break
        return sorted(found, key=lambda n: n.name)
