"""The engine-core process: owns the EngineCore and runs its busy loop.

Loop contract: while any request is unfinished, drain the input queue without blocking and run
one `step()`; when idle, block on the input queue. Each step's output goes out as one `Deltas`
message for all requests. Admission answers (`Admitted`/`Rejected`) are sent before the next
step so a waiting HTTP handler learns its fate within one step. A failure inside `step()` is
unrecoverable: the process sends `CoreFailed` and exits with status 1, and the client fails
every waiting request instead of letting it hang.

Messages leave through an `OutputSender` (see output_sender.py): a slow reader never stalls
the loop, and so the device, on a full pipe; steps that queue up meanwhile go out as one.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import logging
import os
import queue
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from davit_engine.config import EngineConfig
from davit_engine.ipc.framing import write_message
from davit_engine.ipc.messages import (
    AbortRequests,
    AddRequest,
    Admitted,
    CoreFailed,
    Deltas,
    GetStats,
    InputMessage,
    OutputMessage,
    Ready,
    Rejected,
    Shutdown,
    StatsReply,
)
from davit_engine.ipc.output_sender import OutputSender
from davit_engine.types import EngineRequest, EngineStats, ParamError, RequestDelta

logger = logging.getLogger(__name__)

DEFAULT_CORE_FACTORY = "davit_engine.engine_core:EngineCore"

# How often an idle core wakes up to check that its parent is still alive.
_IDLE_POLL_S = 1.0


class EngineCoreLike(Protocol):
    """The part of `davit_engine.engine_core.EngineCore` this loop drives."""

    @property
    def model_info(self) -> Any: ...

    def add_request(self, request: EngineRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def step(self) -> list[RequestDelta]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...


def resolve_factory(path: str) -> Callable[[EngineConfig], EngineCoreLike]:
    """Import `module:attribute` (a class or function taking an EngineConfig)."""
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"core factory must look like 'module:attribute', got {path!r}")
    factory: Callable[[EngineConfig], EngineCoreLike] = getattr(
        importlib.import_module(module_name), attr
    )
    return factory


def to_plain(value: Any) -> Any:
    """Dataclasses, enums and tuples to dicts, values and lists, for JSON and pickling."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    return value


def admission_rejection(request_id: str, exc: Exception) -> Rejected | None:
    """Translate an admission error from `EngineCore.add_request`; None if it is not one."""
    if isinstance(exc, ParamError):
        return Rejected(request_id, "param", exc.message, param=exc.param)
    # Imported here: the scheduler module is the core's, and the API process never needs it.
    from davit_engine.core.scheduler import QueueFullError

    if isinstance(exc, QueueFullError):
        retry_after = exc.retry_after
        return Rejected(
            request_id,
            "queue_full",
            str(exc),
            retry_after_s=float(retry_after),
        )
    return None


class CoreLoop:
    """Drives one EngineCore from an input queue to an output connection."""

    def __init__(
        self,
        core: EngineCoreLike,
        inputs: Any,  # multiprocessing.Queue[InputMessage]; its generic type is not runtime-safe
        outputs: OutputSender,
        parent_pid: int,
    ) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.running = True
        # Optional on a core: raises once the core can no longer run steps (EngineCore: a
        # tensor-parallel rank died), checked every turn of the loop, idle turns included.
        self.check_health: Callable[[], None] | None = getattr(core, "check_health", None)

    def send(self, message: OutputMessage) -> None:
        self.outputs.send(message)

    def run(self) -> None:
        while self.running:
            self.outputs.check()
            if os.getppid() != self.parent_pid:
                logger.warning("engine core: parent process is gone, exiting")
                return
            if self.check_health is not None:
                self.check_health()
            busy = self.core.has_unfinished_requests()
            messages = self._receive(block=not busy)
            for message in messages:
                self._handle(message)
                if not self.running:
                    return
            if self.core.has_unfinished_requests():
                self.send(Deltas(self.core.step(), self.core.stats()))
            elif any(isinstance(m, AddRequest | AbortRequests) for m in messages):
                self.send(Deltas([], self.core.stats()))

    def _receive(self, block: bool) -> list[InputMessage]:
        messages: list[InputMessage] = []
        if block:
            try:
                messages.append(self.inputs.get(timeout=_IDLE_POLL_S))
            except queue.Empty:
                return messages
        while True:
            try:
                messages.append(self.inputs.get_nowait())
            except queue.Empty:
                return messages

    def _handle(self, message: InputMessage) -> None:
        if isinstance(message, AddRequest):
            request_id = message.request.request_id
            try:
                self.core.add_request(message.request)
            except Exception as exc:  # answered to the waiting handler, never swallowed
                rejection = admission_rejection(request_id, exc)
                if rejection is None:
                    logger.exception("engine core: add_request(%s) failed", request_id)
                    rejection = Rejected(request_id, "internal", f"{type(exc).__name__}: {exc}")
                self.send(rejection)
            else:
                self.send(Admitted(request_id))
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
        elif isinstance(message, GetStats):
            self.send(StatsReply(message.token, self.core.stats()))
        elif isinstance(message, Shutdown):
            self.running = False


def run_engine_core(
    config: EngineConfig,
    factory_path: str,
    inputs: Any,
    outputs: Connection,
    parent_pid: int,
) -> None:
    """Child-process entry point (spawn): build the core, report `Ready`, run the loop."""
    # The API process decides when the core stops (after a drain, it sends Shutdown). A SIGTERM
    # or Ctrl-C delivered to the whole process group must not kill the core mid-drain; if the
    # parent itself dies, the loop notices through getppid() and exits.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The core shares CPU cores with the API process (which tokenizes and streams every token);
    # OpenMP's default spin-waiting then makes multi-threaded CPU ops many times slower.
    # Must be set before torch loads OpenMP; an explicit setting by the user wins.
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(message)s")
    try:
        core = resolve_factory(factory_path)(config)
    except ParamError as exc:  # a configuration the user must fix: the message says how
        write_message(outputs.fileno(), CoreFailed(f"{exc.param}: {exc.message}"))
        raise SystemExit(1) from exc
    except Exception as exc:  # reported to the parent, then the process exits non-zero
        message = f"engine core failed to start: {exc!r}\n{traceback.format_exc()}"
        write_message(outputs.fileno(), CoreFailed(message))
        raise SystemExit(1) from exc
    sender = OutputSender(outputs)
    loop = CoreLoop(core, inputs, sender, parent_pid)
    try:
        loop.send(Ready(to_plain(core.model_info)))
        loop.run()
    except Exception as exc:
        logger.exception("engine core loop failed")
        # If the parent is gone the sender drops this: there is nobody left to tell.
        sender.send(CoreFailed(f"engine core failed: {exc!r}\n{traceback.format_exc()}"))
        raise SystemExit(1) from exc
    finally:
        # Flushed before the device is released: the API process learns the outcome first.
        sender.close()
        core.shutdown()
        logger.info("engine core: shut down")
    # Everything queued was written by close(); skipping interpreter teardown (seconds with
    # torch loaded) lets a drained pod exit promptly.
    os._exit(0)
