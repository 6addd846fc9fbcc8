"""Tensor parallelism across processes: the engine core is rank 0; each other rank is a worker
process with its own device (cuda:r, or the CPU under gloo) and its part of the model.

Startup, on every rank in the same order: join the process group (NCCL on GPUs, gloo on the
CPU, plus a gloo control group), load the rank's shards, size memory (the ranks agree on the
smallest block count), allocate the KV cache. Then rank 0 runs the scheduler and sends each
step's inputs as tensors (runner/step_channel.py); the workers run the same forward in
`RunnerV1.follow()` until rank 0 sends SHUTDOWN.

Death of a rank:
- rank 0 watches every worker's process sentinel from a thread. When one exits, the group
  records which rank, how it ended and the error it reported, and kills the other workers.
  The step in flight fails (gloo raises at once when a peer closes its connection; the
  failure is then reported as `RankFailedError` naming the rank); later steps and the engine
  core's idle loop (`EngineCore.check_health`) raise it without touching the group. If a step
  is still blocked in a collective `HANG_GRACE_S` later (NCCL can wait on a dead peer until its
  timeout), the process exits with status 1 after logging the error: no hang.
- workers exit as soon as rank 0's process is gone (parent sentinel), and when a collective
  fails.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from davit_engine.config import EngineConfig
from davit_engine.core.batch import RunnerOutput, SchedulerOutput
from davit_engine.layers.parallel import TensorParallel
from davit_engine.loader import load_model
from davit_engine.runner.base import ModelRunner, RunnerFailure
from davit_engine.runner.step_channel import Command
from davit_engine.runner.v1 import RunnerV1

logger = logging.getLogger(__name__)

# A collective inside a step (or the startup) waits at most this long for a peer.
STEP_TIMEOUT = datetime.timedelta(minutes=10)
# The control group's waits include a worker waiting for the next step while the engine idles.
IDLE_TIMEOUT = datetime.timedelta(days=365)
# How long a failed collective waits for the watchdog to name the rank that died.
IDENTIFY_WAIT_S = 5.0
# How long a step may stay blocked in a collective after a rank died before the process exits.
HANG_GRACE_S = 30.0
_WATCH_POLL_S = 0.5


class RankFailedError(RunnerFailure):
    """A tensor-parallel rank died; the message names it. The engine cannot continue."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is gone"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def _init_group(size: int, rank: int, init_method: str, device: torch.device) -> TensorParallel:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=STEP_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TensorParallel(rank=rank, size=size, group=None, control_group=control)


def _rank_threads(size: int) -> int:
    """CPU threads per rank on the CPU: the machine's share, so ranks do not oversubscribe."""
    return max(1, torch.get_num_threads() // size)


class RankGroup:
    """Rank 0's view of the group: the worker processes, their watchdog, and `tp`."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.size = config.tensor_parallel_size
        self.device = device
        self.failure: str | None = None
        self._failed = threading.Event()
        self._closing = threading.Event()
        self._busy = 0  # collectives in progress on the engine core's thread
        self._dir = tempfile.mkdtemp(prefix="davit-tp-")
        init_method = f"file://{os.path.join(self._dir, 'rendezvous')}"
        threads = _rank_threads(self.size) if device.type == "cpu" else 0
        if threads:
            torch.set_num_threads(threads)
        ctx = multiprocessing.get_context("spawn")
        self.workers: dict[int, BaseProcess] = {}
        self._errors: dict[int, Connection] = {}
        for rank in range(1, self.size):
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=run_rank,
                args=(config, rank, device.type, init_method, threads, writer),
                name=f"davit-tp-rank-{rank}",
                daemon=True,
            )
            process.start()
            writer.close()
            self.workers[rank] = process
            self._errors[rank] = reader
        logger.info(
            "tensor parallelism: %d ranks (%s), workers %s",
            self.size,
            "NCCL" if device.type == "cuda" else "gloo",
            ", ".join(f"rank {r} pid {p.pid}" for r, p in self.workers.items()),
        )
        self._watchdog = threading.Thread(target=self._watch, name="davit-tp-watchdog", daemon=True)
        self._watchdog.start()
        with self.guard():
            self.tp = _init_group(self.size, 0, init_method, device)

    # ---- failure detection --------------------------------------------------------------

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in self.workers.items()}
        while not self._closing.is_set():
            ready = multiprocessing.connection.wait(list(sentinels), timeout=_WATCH_POLL_S)
            if ready and not self._closing.is_set():
                self._on_death(sentinels[ready[0]])  # type: ignore[index]
                return

    def _on_death(self, rank: int) -> None:
        process = self.workers[rank]
        process.join(1.0)
        message = (
            f"tensor-parallel rank {rank} (pid {process.pid}) {_describe_exit(process.exitcode)}"
        )
        reported = self._reported_error(rank)
        if reported:
            message += f": {reported}"
        self.failure = message
        logger.error("%s; stopping the other ranks", message)
        for other, worker in self.workers.items():
            if other != rank and worker.is_alive():
                worker.kill()
        self._failed.set()
        # A step blocked in a collective that never returns (NCCL waits on a dead peer until
        # its timeout) would hang the engine: exit instead.
        self._closing.wait(HANG_GRACE_S)
        if self._busy and not self._closing.is_set():
            logger.critical("%s; a step is still blocked on it, exiting", message)
            sys.stderr.flush()
            os._exit(1)

    def _reported_error(self, rank: int) -> str:
        reader = self._errors[rank]
        try:
            if reader.poll(0):
                return str(reader.recv())
        except (EOFError, OSError):
            pass
        return ""

    def check(self) -> None:
        """Raise RankFailedError if a rank has died."""
        if self.failure is not None:
            raise RankFailedError(self.failure)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around work with collectives: a dead rank beforehand raises RankFailedError; an
        error raised inside because a rank died becomes RankFailedError naming it."""
        self.check()
        self._busy += 1
        try:
            yield
        except Exception as exc:
            if self._may_be_rank_death(exc) and self._failed.wait(IDENTIFY_WAIT_S):
                raise RankFailedError(str(self.failure)) from exc
            raise
        finally:
            self._busy -= 1

    def _may_be_rank_death(self, exc: Exception) -> bool:
        """Whether `exc` may come from a collective whose peer died (worth waiting for the
        watchdog); an ordinary error, such as one request's, is raised at once."""
        if self._failed.is_set() or not all(p.is_alive() for p in self.workers.values()):
            return True
        if isinstance(exc, dist.DistError):
            return True
        text = str(exc)
        return isinstance(exc, RuntimeError) and any(
            word in text for word in ("gloo", "NCCL", "Connection closed", "Connection reset")
        )

    # ---- shutdown -------------------------------------------------------------------------

    def close(self, channel_shutdown: Any = None) -> None:
        """Stop the workers (after `channel_shutdown()`, which tells them to exit, when the
        group is healthy) and leave the process group. Safe to call twice."""
        if self._closing.is_set():
            return
        healthy = self.failure is None
        self._closing.set()
        if healthy and channel_shutdown is not None:
            try:
                channel_shutdown()
            except Exception as exc:  # a worker died meanwhile: it is killed below
                logger.warning("tensor parallelism: shutdown message failed: %s", exc)
        for process in self.workers.values():
            process.join(10.0 if healthy else 0.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)


class ParallelRunner(ModelRunner):
    """Rank 0's runner: the RunnerV1 over its shards, its collectives guarded by the group.

    Steps stay repeatable (runner V1's are): a step that failed on rank 0 after the forward
    (one request's sampling) runs again on every rank, in parts, like any other step.
    """

    repeatable_steps = True

    def __init__(self, runner: RunnerV1, ranks: RankGroup) -> None:
        self.runner = runner
        self.ranks = ranks
        self.name = runner.name

    @property
    def memory_profile(self) -> Any:
        return self.runner.memory_profile

    def determine_num_blocks(self) -> int:
        with self.ranks.guard():
            num_blocks: int = self.runner.determine_num_blocks()
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        channel = self.runner.channel
        assert channel is not None
        with self.ranks.guard():
            channel.send_command(Command.INIT_KV_CACHE, num_blocks)
        self.runner.initialize_kv_cache(num_blocks)

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        with self.ranks.guard():
            output: RunnerOutput = self.runner.execute(batch)
        return output

    def shutdown(self) -> None:
        channel = self.runner.channel
        assert channel is not None
        self.ranks.close(lambda: channel.send_command(Command.SHUTDOWN))
        self.runner.shutdown()


def run_rank(
    config: EngineConfig,
    rank: int,
    device_type: str,
    init_method: str,
    threads: int,
    errors: Connection,
) -> None:
    """A worker process's entry point (spawn): rank `rank` on `cuda:rank` (device_type
    "cuda") or the CPU, until rank 0 says stop; on failure its error goes to `errors`."""
    # Ctrl-C reaches the whole process group; rank 0 decides when the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(message)s")
    if threads:
        torch.set_num_threads(threads)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(
            target=_exit_with_parent, args=(parent.sentinel,), name="parent-watch", daemon=True
        ).start()
    if device_type == "cuda":
        device = torch.device(f"cuda:{rank}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    try:
        tp = _init_group(config.tensor_parallel_size, rank, init_method, device)
        loaded = load_model(config, device, tp)
        runner = RunnerV1(config, loaded, device)
        runner.determine_num_blocks()
        runner.follow()
        runner.shutdown()
        dist.destroy_process_group()
    except BaseException as exc:
        logger.exception("tensor-parallel rank %d failed", rank)
        with contextlib.suppress(OSError):
            errors.send(f"{type(exc).__name__}: {exc}"[:2000])
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _exit_with_parent(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)
