"""The status patch: the top-level fields whose value changed, for kopf's merge patch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from davit_operator.api.status import InferenceServiceStatus


def status_fields(status: InferenceServiceStatus) -> dict[str, Any]:
    """The fields the status sets, as they go on the wire (None deletes a field)."""
    return status.model_dump(mode="json", by_alias=True, exclude_unset=True)


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


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value
