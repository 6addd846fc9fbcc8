"""The model's part of the status: `status.model` and the ModelReady condition, and how a
fetch in progress shows in the kstatus conditions (Reconciling while the new revision is
fetched; Ready only once replicas run, which they do only after the model is present)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from davit_operator.api.status import (
    MODEL_READY,
    READY,
    RECONCILING,
    ConditionStatus,
    InferenceServiceStatus,
    ModelStatus,
)
from davit_operator.delivery import Delivery
from davit_operator.status.conditions import ConditionState, set_conditions

_READY_BY_STATE: dict[str, tuple[ConditionStatus, str]] = {
    "Present": ("True", "Fetched"),
    "Mounted": ("True", "Mounted"),
    "NotNeeded": ("True", "RandomWeights"),
    "Unmanaged": ("Unknown", "NoModelCache"),
    "Fetching": ("False", "Fetching"),
    "Failed": ("False", "FetchFailed"),
}


def model_status(source: str, revision: str | None, delivery: Delivery) -> ModelStatus:
    entry = delivery.entry
    result = delivery.result
    progress = delivery.progress
    done = total = files = None
    if result is not None:
        done = total = result.bytes_total
    elif progress is not None and progress.bytes_total:
        done, total, files = progress.bytes_done, progress.bytes_total, progress.files_total
    return ModelStatus(
        source=source,
        revision=revision,
        state=delivery.state,
        cache=entry.claim if entry is not None else None,
        entry=f"davit-model-{entry.key}" if entry is not None else None,
        commit=result.commit if result is not None else None,
        bytes_done=done,
        bytes_total=total,
        files=files,
    )


def with_model(
    status: InferenceServiceStatus,
    delivery: Delivery,
    source: str,
    revision: str | None,
    *,
    has_replicas: bool,
    written: Mapping[str, Any],
    now: str,
    generation: int,
) -> InferenceServiceStatus:
    """`status` with `status.model`, the ModelReady condition and, while the model is being
    fetched, Reconciling (and Ready=False when no replica runs yet)."""
    condition_status, reason = _READY_BY_STATE[delivery.state]
    if delivery.state == "Failed" and delivery.reason:
        reason = delivery.reason
    states = [ConditionState(MODEL_READY, condition_status, reason, delivery.message)]
    if delivery.state == "Fetching":
        states.append(ConditionState(RECONCILING, "True", "FetchingModel", delivery.message))
        if not has_replicas:
            states.append(ConditionState(READY, "False", "FetchingModel", delivery.message))
    conditions = set_conditions(
        status.conditions,
        states,
        written=written.get("conditions") or [],
        generation=generation,
        now=now,
    )
    return status.model_copy(
        update={"model": model_status(source, revision, delivery), "conditions": conditions}
    )
