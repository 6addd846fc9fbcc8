"""Per-object state across reconciles, kept in kopf's per-object memo (dropped with the object).

The watch caches lag behind the operator's own writes. A reconcile that runs before the watch
event of its previous apply arrives must neither apply the same object again nor undo the
rollout status it just wrote; these records stand in for the missing events for a while.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from davit_operator.rollout.controller import RolloutMemory

# How long an own write stands in for a watch event that has not arrived yet.
RECENT_WRITE_SECONDS = 60.0


@dataclass(frozen=True)
class RecentApply:
    """A child this process applied: its desired-state hash, the API server's answer, and when
    (time.monotonic)."""

    desired_hash: str
    live: dict[str, Any]
    at: float


@dataclass(frozen=True)
class RecentDelete:
    """A child this process deleted (by uid), and when (time.monotonic)."""

    uid: str
    at: float


@dataclass
class ObjectMemo:
    """Everything one InferenceService's reconciles remember between runs. `lock` serialises
    its triggers (the drift timer runs beside the event handlers); `applies` is keyed by kind,
    or `kind/name` for a child not named after the service (the canary Deployment); `deletes`
    by the kind of an optional child deleted because the spec no longer wants it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    applies: dict[str, RecentApply] = field(default_factory=dict)
    deletes: dict[str, RecentDelete] = field(default_factory=dict)
    rollout: RolloutMemory = field(default_factory=RolloutMemory)
