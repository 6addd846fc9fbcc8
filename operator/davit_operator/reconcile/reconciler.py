"""The reconcile every kopf trigger runs: plan, apply, report, under the object's lock.

It reads live children from kopf indexes (watch caches) rather than the API server, writes only
children that differ from the desired state, and puts only the status fields that changed into
kopf's patch, so an idle reconcile sends no request.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import kopf

from davit_operator.kube import KubeError
from davit_operator.metrics import RECONCILE_DURATION, RECONCILE_ERRORS, RECONCILE_TOTAL
from davit_operator.reconcile.apply import apply_planned
from davit_operator.reconcile.indexes import Indexes
from davit_operator.reconcile.memo import ObjectMemo
from davit_operator.reconcile.plan import Subject, plan_object
from davit_operator.reconcile.report import report
from davit_operator.reconcile.runtime import Runtime


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def reconcile(
    *,
    trigger: str,
    runtime: Runtime,
    body: kopf.Body,
    patch: kopf.Patch,
    indexes: Indexes,
    memo: ObjectMemo,
    retry_delay: float,
) -> None:
    """Level-based reconcile of one InferenceService (see the module docstring). API errors
    worth retrying raise kopf.TemporaryError; a spec that cannot be served stalls in status."""
    started = time.monotonic()
    subject = Subject.of(body)
    result = "ok"
    async with memo.lock:
        try:
            planned = await plan_object(runtime, body, subject, indexes, memo)
            outcome = await apply_planned(runtime, body, subject, planned, indexes, memo)
            if outcome.planned.error is not None:
                result = "stalled"
                RECONCILE_ERRORS.labels(kind="spec").inc()
            report(runtime.post_event, body, patch, subject, outcome, _now())
        except KubeError as exc:
            result = "retry"
            RECONCILE_ERRORS.labels(kind="api").inc()
            raise kopf.TemporaryError(f"API server: {exc.message}", delay=retry_delay) from exc
        except Exception:
            result = "error"
            RECONCILE_ERRORS.labels(kind="unexpected").inc()
            raise
        finally:
            RECONCILE_TOTAL.labels(trigger=trigger, result=result).inc()
            RECONCILE_DURATION.labels(trigger=trigger).observe(time.monotonic() - started)
