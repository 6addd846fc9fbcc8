"""The building blocks every API model shares: the base model, the quantity type, CEL rules and
object defaults. The spec, rollout and status modules build on these and never on each other's
internals."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, WithJsonSchema
from pydantic.alias_generators import to_camel

# A Kubernetes quantity ("4", 4, "500m", "16Gi"): int-or-string in the schema.
Quantity = Annotated[
    int | str,
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
        }
    ),
]


def cel_rule(
    rule: str, message: str, field_path: str | None = None, **extra: str
) -> dict[str, Any]:
    """One `x-kubernetes-validations` entry."""
    entry: dict[str, Any] = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    entry.update(extra)
    return entry


def object_default(model: type[BaseModel]) -> dict[str, Any]:
    """The CRD default of an optional object field: the model's defaults, spelled out, so the
    API server's validation of the default itself sees every field the CEL rules read."""
    dumped = model().model_dump(mode="json", by_alias=True, exclude_none=True)
    return {k: v for k, v in dumped.items() if v != [] and v != {}}


class CrdModel(BaseModel):
    """Base for every schema model: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )
