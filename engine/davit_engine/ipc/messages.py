"""Typed messages between the API process and the engine-core process.

Everything here is pickled across a pipe, so fields are Python scalars, lists and the plain
dataclasses of `davit_engine.types`; never tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from davit_engine.types import EngineRequest, EngineStats, RequestDelta

# --- API process -> engine core ---------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    """Admit `request`; the core answers with `Admitted` or `Rejected` for its id."""

    request: EngineRequest


@dataclass(frozen=True)
class AbortRequests:
    """Stop these requests and free their blocks. Unknown or finished ids are ignored."""

    request_ids: list[str]


@dataclass(frozen=True)
class GetStats:
    """Ask for a fresh `EngineStats`; answered by `StatsReply` with the same `token`."""

    token: int


@dataclass(frozen=True)
class Shutdown:
    """Abort everything, release the device and exit the loop."""


InputMessage = AddRequest | AbortRequests | GetStats | Shutdown

# --- engine core -> API process ---------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The model is loaded and the loop runs. `model_info` is the core's ModelInfo as a dict."""

    model_info: dict[str, Any]


@dataclass(frozen=True)
class Admitted:
    request_id: str


@dataclass(frozen=True)
class Rejected:
    """Admission failed. `kind` is `param` (the user must fix `param`) or `queue_full`.

    `retry_after_s` is the core's hint for a full queue (the HTTP `Retry-After` header).
    """

    request_id: str
    kind: str
    message: str
    param: str | None = None
    retry_after_s: float | None = None


@dataclass(frozen=True)
class Deltas:
    """What one engine step produced, for every request that made progress.

    `stats` is the core's state right after the step (or after applying inputs while idle), so
    the front end always knows the latest state without asking and waiting for a step to end.
    """

    deltas: list[RequestDelta] = field(default_factory=list)
    stats: EngineStats | None = None


@dataclass(frozen=True)
class StatsReply:
    token: int
    stats: EngineStats


@dataclass(frozen=True)
class CoreFailed:
    """The core hit an error it cannot recover from; the process exits after sending this."""

    message: str


OutputMessage = Ready | Admitted | Rejected | Deltas | StatsReply | CoreFailed
