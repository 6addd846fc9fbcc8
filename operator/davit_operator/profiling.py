"""Profile once per identity: find the stored profile, or run the profiling Job and store its
result. The only part of memory planning that talks to the API server (through KubeClient).

Storage: one ConfigMap per identity in the InferenceService's namespace, named and labelled by
the identity hash. Status would tie a profile to one InferenceService and lose it with it; a
ConfigMap is shared by every InferenceService of that identity, survives deletes and
re-creates, and is readable with kubectl.

States of one reconcile:
- ConfigMap present: the plan gets the profile's KV bytes (`--kv-cache-memory-bytes`);
- no ConfigMap, no Job: the Job is created; the plan is pending (no replicas yet);
- Job pod terminated with a message: the profile is validated and stored; as above;
- Job pod failed, or a message that is no profile: PlanError (stalled with the reason);
- otherwise pending: the drift timer looks again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from davit_contract.profile import MemoryProfile, ProfileFormatError
from davit_operator.builders.metadata import Owner
from davit_operator.builders.profile_job import (
    PROFILE_KEY,
    profile_config_map,
    profile_job,
    profile_name,
)
from davit_operator.kube import KubeClient
from davit_operator.planning.errors import PlanError
from davit_operator.planning.memory import (
    MemoryPlan,
    identity_hash,
    profile_identity,
    profile_plan,
    with_memory,
)
from davit_operator.planning.plan import Plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileOutcome:
    """The plan to use (with its memory plan) and whether replicas may start."""

    plan: Plan
    ready: bool
    action: str | None = None  # "created profiling Job", "stored profile" (for events)


class ProfileCache:
    """Profiles this process has read or stored, by identity hash. Lets synchronous planning
    (the stable revision's plan during a canary) give replicas the same KV bytes as before,
    so re-rendering an unchanged revision never changes its pod template."""

    def __init__(self) -> None:
        self._profiles: dict[str, MemoryProfile] = {}

    def remember(self, identity: str, profile: MemoryProfile) -> None:
        self._profiles[identity] = profile

    def apply(self, plan: Plan) -> Plan:
        """`plan` with its identity's known profile; unchanged when none is known."""
        if not needs_profile(plan):
            return plan
        identity = identity_hash(profile_identity(plan))
        profile = self._profiles.get(identity)
        if profile is None:
            return plan
        return with_memory(plan, profile_plan(profile, identity, profile_name(identity)))


def needs_profile(plan: Plan) -> bool:
    """Our engine, and no explicit KV size: upstream images have no `--profile-only`."""
    memory = plan.memory
    if memory is not None and memory.source == "explicit":
        return False
    return plan.image.engine_type == "davit"


def replicas_may_start(plan: Plan) -> bool:
    """False while the profile the replicas need is still being measured."""
    return plan.memory is None or plan.memory.source != "pending"


def _pending(plan: Plan, identity: str, message: str) -> Plan:
    estimate = plan.memory
    base = MemoryPlan(source="pending", identity_hash=identity, message=message)
    if estimate is not None:
        base = MemoryPlan(
            source="pending",
            identity_hash=identity,
            message=message,
            kv_cache_bytes=estimate.kv_cache_bytes,
            weights_bytes=estimate.weights_bytes,
            activation_bytes=estimate.activation_bytes,
            cuda_graph_bytes=estimate.cuda_graph_bytes,
            non_torch_bytes=estimate.non_torch_bytes,
            token_capacity=estimate.token_capacity,
            max_model_len=estimate.max_model_len,
            max_concurrency=estimate.max_concurrency,
            profile_name=profile_name(identity),
        )
    return with_memory(plan, base)


def _terminated(pod: dict[str, Any]) -> dict[str, Any] | None:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == "engine":
            terminated = (status.get("state") or {}).get("terminated")
            return dict(terminated) if terminated else None
    return None


async def resolve_profile(
    kube: KubeClient, plan: Plan, owner: Owner, cache: ProfileCache | None = None
) -> ProfileOutcome:
    """See the module docstring. Raises PlanError for a failed or unreadable profile run and
    KubeError for API errors (the caller retries those). Profiles found go into `cache`."""
    identity_doc = profile_identity(plan)
    identity = identity_hash(identity_doc)
    name = profile_name(identity)
    namespace = plan.namespace
    stored = await kube.get("ConfigMap", namespace, name)
    if stored is not None:
        text = (stored.get("data") or {}).get(PROFILE_KEY, "")
        try:
            profile = MemoryProfile.from_json(text)
        except ProfileFormatError as exc:
            raise _invalid(name, f"ConfigMap {name} holds no usable profile: {exc}") from exc
        if cache is not None:
            cache.remember(identity, profile)
        return ProfileOutcome(with_memory(plan, profile_plan(profile, identity, name)), True)
    job = await kube.get("Job", namespace, name)
    if job is None:
        await kube.apply(profile_job(plan, owner, identity))
        logger.info("%s/%s: created profiling Job %s", namespace, plan.name, name)
        message = f"profiling Job {name} created"
        return ProfileOutcome(_pending(plan, identity, message), False, message)
    for pod in await kube.list("Pod", namespace, f"job-name={name}"):
        terminated = _terminated(pod)
        if terminated is None:
            continue
        message = str(terminated.get("message") or "")
        if int(terminated.get("exitCode", 1)) != 0:
            raise PlanError(
                field="spec",
                value=None,
                reason="ProfilingFailed",
                condition="",
                message=f"profiling Job {name} failed (exit {terminated.get('exitCode')}, "
                f"{terminated.get('reason', '')}): {message[-1500:] or 'no message'}; delete "
                "the Job to profile again",
            )
        if not message:
            continue  # the kubelet writes the message with the final state
        try:
            profile = MemoryProfile.from_json(message)
        except ProfileFormatError as exc:
            raise _invalid(name, f"profiling Job {name} wrote no usable profile: {exc}") from exc
        identity_json = json.dumps(identity_doc, sort_keys=True, default=str)
        await kube.apply(profile_config_map(namespace, identity, profile.to_json(), identity_json))
        logger.info("%s/%s: stored profile %s", namespace, plan.name, name)
        if cache is not None:
            cache.remember(identity, profile)
        memory = profile_plan(profile, identity, name)
        return ProfileOutcome(with_memory(plan, memory), True, f"stored profile {name}")
    conditions = (job.get("status") or {}).get("conditions") or []
    failed = next((c for c in conditions if c.get("type") == "Failed"), None)
    if failed is not None and failed.get("status") == "True":
        raise PlanError(
            field="spec",
            value=None,
            reason="ProfilingFailed",
            condition="",
            message=f"profiling Job {name} failed: {failed.get('reason')}: "
            f"{failed.get('message', '')}; delete the Job to profile again",
        )
    return ProfileOutcome(_pending(plan, identity, f"profiling Job {name} running"), False)


def _invalid(name: str, message: str) -> PlanError:
    return PlanError(
        field="spec",
        value=None,
        reason="ProfileInvalid",
        condition="",
        message=f"{message}; delete {name} to profile again",
    )
