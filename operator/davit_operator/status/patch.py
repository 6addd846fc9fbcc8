"""The status patch: the top-level fields whose value changed, for kopf's merge patch.

A JSON merge patch gives `null` two meanings. As the value of an object's key it deletes that
key, which is how a field the new status no longer sets goes away. Inside a list it means
nothing: a list is replaced whole, and the API server prunes a null it stores for a field the
schema does not mark nullable. kopf compares the patch it sent with the object the server
returned, so a list item carrying `"digest": null` would come back without the key and be logged
as an inconsistency on every write of that list. Lists therefore go on the wire without their
null fields; what the server stores is then exactly what was sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from davit_operator.api.status import InferenceServiceStatus


def status_fields(status: InferenceServiceStatus) -> dict[str, Any]:
    """The fields the status sets, as they go on the wire (None deletes a field; list items
    carry no None)."""
    fields = status.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return {key: _wire(value) for key, value in fields.items()}


def status_patch(old: Mapping[str, Any], new: InferenceServiceStatus) -> dict[str, Any]:
    """Top-level keys of `new`'s set fields whose value differs from `old` (None deletes);
    empty when nothing changed. Fields `new` does not set are left as they are."""
    patch: dict[str, Any] = {}
    for key, value in status_fields(new).items():
        current = old.get(key)
        if value is None and current is None:
            continue
        if _strip_none(current) != _strip_none(value):
            patch[key] = value
    return patch


def _wire(value: Any) -> Any:
    """`value` with None kept as a deletion in objects and dropped from inside lists."""
    if isinstance(value, dict):
        return {k: _wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value
