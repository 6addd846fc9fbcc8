"""Rollouts: rolling and canary updates gated on the engines' metrics, with rollback.

`machine` decides (pure), `metrics` reads the canary engines, `controller` wires both into a
reconcile, `revision` names what the replicas run.
"""

from davit_operator.rollout.controller import (
    RolloutMemory,
    RolloutResult,
    apply_rollout_effects,
    canary_name,
    plan_rollout,
    rollout_status,
)

__all__ = [
    "RolloutMemory",
    "RolloutResult",
    "apply_rollout_effects",
    "canary_name",
    "plan_rollout",
    "rollout_status",
]
