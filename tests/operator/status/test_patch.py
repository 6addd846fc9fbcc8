"""The status patch as the API server applies it: kopf finds no inconsistency to log.

kopf compares every merge patch it sends with the object the server returns and logs "Merge-patching
finished with inconsistencies" at warning level for any difference. The server here is modelled by
RFC 7386 (a null deletes an object's key; a list is replaced whole) followed by the structural
schema's pruning of nulls in fields that are not nullable; the comparison is kopf's own.
"""

from __future__ import annotations

import copy
from typing import Any

from kopf._cogs.structs import diffs

from davit_operator.api.rollout import RevisionRecord, RolloutStatus
from davit_operator.api.status import Condition, InferenceServiceStatus
from davit_operator.status.patch import status_fields, status_patch


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result


def _prune_nulls(value: Any) -> Any:
    """What the API server stores: no field of the status schema is nullable."""
    if isinstance(value, dict):
        return {k: _prune_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_prune_nulls(v) for v in value]
    return value


def _server_applies(stored: dict[str, Any], status_changes: dict[str, Any]) -> dict[str, Any]:
    body = {"status": stored}
    result: dict[str, Any] = _prune_nulls(_merge(body, {"status": status_changes}))
    return result


def _revision(name: str, **fields: Any) -> RevisionRecord:
    """A record as the rollout builds it: every field set, unknown ones to None."""
    values: dict[str, Any] = {
        "revision": name,
        "image": f"ghcr.io/davit-dev/davit-engine:{name}",
        "digest": None,
        "engine_args": ["davit", "serve", "m"],
        "strategy": "Rolling",
        "started_at": "2026-01-01T00:00:00Z",
        "finished_at": None,
        "outcome": "Progressing",
    }
    return RevisionRecord(**{**values, **fields})


def _status(*revisions: RevisionRecord, step: int | None) -> InferenceServiceStatus:
    return InferenceServiceStatus(
        observed_generation=2,
        conditions=[
            Condition(
                type="Ready",
                status="True",
                reason="ReplicasReady",
                message="",
                last_transition_time="2026-01-01T00:00:00Z",
            )
        ],
        rollout=RolloutStatus(phase="Progressing", strategy="Rolling", step=step),
        revisions=list(revisions),
    )


def test_list_items_go_on_the_wire_without_nulls() -> None:
    fields = status_fields(_status(_revision("a"), step=None))
    (record,) = fields["revisions"]
    assert "digest" not in record and "finishedAt" not in record
    assert record["revision"] == "a" and record["engineArgs"] == ["davit", "serve", "m"]
    # Outside lists None stays: it is how the merge patch deletes a field.
    assert fields["rollout"]["step"] is None


def test_a_rollout_patch_comes_back_exactly_as_sent() -> None:
    stored: dict[str, Any] = {}
    for status in (
        _status(_revision("a"), step=0),
        _status(_revision("a"), _revision("b", digest="sha256:" + "0" * 64), step=None),
        _status(_revision("a", finished_at="2026-01-01T00:05:00Z"), _revision("b"), step=1),
    ):
        changes = status_patch(stored, status)
        assert changes, "every step changes the status"
        patch = {"status": changes}
        returned = _server_applies(stored, changes)
        inconsistencies = diffs.diff(patch, returned, scope=diffs.DiffScope.LEFT)
        assert not inconsistencies, inconsistencies
        stored = returned["status"]
        # Nothing changed: the next reconcile sends nothing.
        assert status_patch(stored, status) == {}
    assert "step" in stored["rollout"] and "finishedAt" not in stored["revisions"][1]
