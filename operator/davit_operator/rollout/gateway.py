"""Canary weights on a Gateway API HTTPRoute instead of replica ratios.

The user owns the HTTPRoute (its parents, matches and filters); the operator only rewrites the
`backendRefs` of the rules that point at this InferenceService (its Service, or the per-track
Services of `builders.service`), to the stable and canary Services with the step's weights.
Pods carry a track label (`stable` or `canary`), so each Service selects one side.
"""

from __future__ import annotations

from typing import Any

from davit_operator.builders.deployment import TRACKS
from davit_operator.builders.service import track_service_name

GATEWAY_VERSION = "gateway.networking.k8s.io/v1"


def _is_ours(ref: dict[str, Any], names: set[str]) -> bool:
    return (
        ref.get("name") in names
        and ref.get("kind", "Service") == "Service"
        and ref.get("group", "") == ""
    )


def _ref(name: str, port: int, weight: int) -> dict[str, Any]:
    return {"group": "", "kind": "Service", "name": name, "port": port, "weight": weight}


def weighted_rules(
    rules: list[dict[str, Any]], service: str, port: int, weight: int
) -> list[dict[str, Any]]:
    """`rules` with every rule that routes to `service` (or its track Services) sending
    `100 - weight` to NAME-stable and `weight` to NAME-canary; other backends of such a rule
    and all other rules are left as they are."""
    stable, canary = (track_service_name(service, t) for t in TRACKS)
    names = {service, stable, canary}
    out = []
    for rule in rules:
        refs = list(rule.get("backendRefs") or [])
        if any(_is_ours(r, names) for r in refs):
            others = [r for r in refs if not _is_ours(r, names)]
            rule = {
                **rule,
                "backendRefs": [
                    *others,
                    # Spelled out as the API server defaults them, so a reread compares equal.
                    _ref(stable, port, 100 - weight),
                    _ref(canary, port, weight),
                ],
            }
        out.append(rule)
    return out


def routes_to(rules: list[dict[str, Any]], service: str) -> bool:
    names = {service, *(track_service_name(service, t) for t in TRACKS)}
    return any(_is_ours(r, names) for rule in rules for r in rule.get("backendRefs") or [])
