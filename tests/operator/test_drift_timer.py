"""Reconciles are bounded, and the drift timer yields to the event handlers: a bounded number of
checks at once, and a check that would wait, or whose object a handler is reconciling, skips
its round; creations beyond the bound wait their turn instead of failing."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from davit_operator import handlers
from davit_operator.handlers import (
    MAX_CONCURRENT_DRIFT_CHECKS,
    MAX_CONCURRENT_RECONCILES,
    OperatorOptions,
    register,
)
from davit_operator.reconcile.memo import ObjectMemo


def _handlers() -> dict[str, Any]:
    registry = kopf.OperatorRegistry()
    register(registry, OperatorOptions())
    found = [*registry._spawning.get_all_handlers(), *registry._changing.get_all_handlers()]
    return {h.id: h.fn for h in found}


def _drift_handler() -> Any:
    return _handlers()["drift"]


def _kwargs() -> dict[str, Any]:
    indexes: dict[str, Any] = {name: {} for name in handlers.CHILD_INDEXES}
    return {"body": {}, "patch": {}, "node_index": {}, **indexes}


def test_drift_checks_are_bounded_and_skip_when_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    drift = _drift_handler()
    running = 0
    peak = 0
    calls = 0
    release = asyncio.Event()

    async def slow_reconcile(**_: Any) -> None:
        nonlocal running, peak, calls
        calls += 1
        running += 1
        peak = max(peak, running)
        await release.wait()
        running -= 1

    monkeypatch.setattr(handlers, "reconcile", slow_reconcile)

    async def scenario() -> None:
        memos = [kopf.Memo(runtime=None) for _ in range(3 * MAX_CONCURRENT_DRIFT_CHECKS)]
        tasks = [asyncio.create_task(drift(memo=m, **_kwargs())) for m in memos]
        await asyncio.sleep(0.05)
        # The first checks hold every slot; the others returned at once instead of queueing.
        assert running == MAX_CONCURRENT_DRIFT_CHECKS
        assert sum(t.done() for t in tasks) == 2 * MAX_CONCURRENT_DRIFT_CHECKS
        release.set()
        await asyncio.gather(*tasks)
        # A handler holds this object's lock: its drift check skips rather than waits.
        busy = kopf.Memo(runtime=None)
        state = busy.setdefault("reconcile", ObjectMemo())
        async with state.lock:
            await asyncio.wait_for(drift(memo=busy, **_kwargs()), timeout=1)
        # Free slots and a free object: the check runs.
        await drift(memo=kopf.Memo(runtime=None), **_kwargs())

    asyncio.run(scenario())
    assert peak == MAX_CONCURRENT_DRIFT_CHECKS
    assert calls == MAX_CONCURRENT_DRIFT_CHECKS + 1


def test_creations_beyond_the_bound_wait_their_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    fns = _handlers()
    create, drift = fns["create"], fns["drift"]
    running = 0
    peak = 0
    done = 0

    async def reconcile(**_: Any) -> None:
        nonlocal running, peak, done
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        done += 1

    monkeypatch.setattr(handlers, "reconcile", reconcile)

    async def scenario() -> None:
        count = 5 * MAX_CONCURRENT_RECONCILES
        creations = [
            asyncio.create_task(create(memo=kopf.Memo(runtime=None), **_kwargs()))
            for _ in range(count)
        ]
        await asyncio.sleep(0)
        # Every slot is taken by creations: a drift check skips rather than queue behind them.
        await asyncio.wait_for(drift(memo=kopf.Memo(runtime=None), **_kwargs()), timeout=1)
        await asyncio.gather(*creations)

    asyncio.run(scenario())
    assert peak == MAX_CONCURRENT_RECONCILES
    assert done == 5 * MAX_CONCURRENT_RECONCILES  # every creation ran; the drift check did not
