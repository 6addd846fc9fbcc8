"""Why a call to the engine-core process failed: the core is not running, or it refused.

Kept apart from the client so that the request streams, which end with `EngineDeadError`, and
the client, which creates them, both import it without importing each other.
"""

from __future__ import annotations

from davit_engine.ipc.messages import Rejected


class EngineDeadError(RuntimeError):
    """The engine-core process is not running (failed to start, crashed or shut down)."""


class AdmissionError(Exception):
    """The core refused a request; `rejection` says why (see `messages.Rejected`)."""

    def __init__(self, rejection: Rejected) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection
