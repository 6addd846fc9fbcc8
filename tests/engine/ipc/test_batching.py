"""The core-to-API path in batches: merging deltas, coalescing steps behind a full pipe, framing.

These run the real pieces (a real pipe, the real sender thread, the real core loop with the
benchmark's model-free core) in this process; test_api_fake.py runs them across processes.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import queue
import select
import threading
import time
from typing import Any

import pytest

from davit_engine.config import EngineConfig
from davit_engine.ipc.core_process import CoreLoop
from davit_engine.ipc.errors import EngineDeadError
from davit_engine.ipc.framing import MessageReader, write_message
from davit_engine.ipc.messages import AddRequest, Admitted, Deltas, Shutdown, merge_deltas
from davit_engine.ipc.output_sender import OutputSender
from davit_engine.ipc.request_stream import RequestStream
from davit_engine.types import (
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestDelta,
    SamplingParams,
    TokenLogprob,
)
from davit_tools.bench.api_stream import SCRIPT, StreamCore


def delta(
    request_id: str,
    ids: list[int],
    logprobs: bool = False,
    finish: FinishReason | None = None,
    cached: int = 0,
) -> RequestDelta:
    lps = [TokenLogprob(t, -float(t), [(t, -float(t))]) for t in ids] if logprobs else None
    return RequestDelta(request_id, ids, lps, finish, None, 7, cached)


# --- merging ------------------------------------------------------------------------------------


def test_merge_deltas_keeps_tokens_logprobs_and_outcome_in_order() -> None:
    merged = merge_deltas(
        [
            delta("r", [1, 2], logprobs=True),
            delta("r", [3], logprobs=True, cached=4),
            delta("r", [4, 5], logprobs=True, finish=FinishReason.LENGTH),
        ]
    )
    assert merged.request_id == "r"
    assert merged.new_token_ids == [1, 2, 3, 4, 5]
    assert merged.logprobs is not None
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4, 5]
    assert [lp.logprob for lp in merged.logprobs] == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert merged.finish_reason is FinishReason.LENGTH
    assert merged.num_prompt_tokens == 7 and merged.num_cached_tokens == 4
    without = merge_deltas([delta("r", [1]), delta("r", [2])])
    assert without.logprobs is None and without.finish_reason is None


def test_coalesce_gives_one_delta_per_request_and_the_latest_stats() -> None:
    steps = [
        Deltas([delta("a", [1]), delta("b", [10])], EngineStats(num_running=2)),
        Deltas([delta("b", [11]), delta("a", [2], finish=FinishReason.STOP)], None),
        Deltas([delta("b", [12]), delta("c", [20])], EngineStats(num_running=1)),
    ]
    merged = Deltas.coalesce(steps)
    assert [d.request_id for d in merged.deltas] == ["a", "b", "c"]
    assert [d.new_token_ids for d in merged.deltas] == [[1, 2], [10, 11, 12], [20]]
    assert [d.finish_reason for d in merged.deltas] == [FinishReason.STOP, None, None]
    assert merged.stats == EngineStats(num_running=1)
    assert Deltas.coalesce(steps[:1]) is steps[0]


def test_deltas_survive_pickling_field_for_field() -> None:
    message = Deltas(
        [
            delta("a", [1, 2], logprobs=True, cached=3),
            RequestDelta("b", [7], None, FinishReason.STOP, 7, 5, 0),
            delta("c", [], finish=FinishReason.ABORT),
        ],
        EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.25),
    )
    copy = pickle.loads(pickle.dumps(message))
    assert copy == message
    assert copy.deltas[1].finish_reason is FinishReason.STOP
    assert copy.deltas[0].logprobs is not None
    assert isinstance(copy.deltas[0].logprobs[0], TokenLogprob)


# --- framing ------------------------------------------------------------------------------------


def test_message_reader_waits_for_whole_frames_and_reports_eof() -> None:
    source_r, source_w = os.pipe()
    write_message(source_w, Admitted("x" * 5000))
    frame = os.read(source_r, 1 << 20)
    os.close(source_r)
    os.close(source_w)
    read_end, write_end = os.pipe()
    reader = MessageReader(read_end)
    try:
        assert reader.read() == ([], False)
        os.write(write_end, frame[:3000])
        assert reader.read() == ([], False)  # a partial frame stays buffered
        os.write(write_end, frame[3000:] + frame)
        assert reader.read() == ([Admitted("x" * 5000)] * 2, False)
        os.close(write_end)
        assert reader.read() == ([], True)
    finally:
        os.close(read_end)


# --- the sender thread --------------------------------------------------------------------------


def read_until(reader: MessageReader, count: int, timeout_s: float = 10.0) -> list[Any]:
    messages: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(messages) < count:
        assert time.monotonic() < deadline, f"got {len(messages)} of {count} messages"
        select.select([reader.fd], [], [], 0.1)
        messages += reader.read()[0]
    return messages


def test_sender_coalesces_steps_queued_behind_a_full_pipe() -> None:
    read_conn, write_conn = multiprocessing.get_context("spawn").Pipe(duplex=False)
    sender = OutputSender(write_conn)
    try:
        # Far more than a pipe holds: the sender stays blocked in this write until we read.
        big = Deltas([delta("big", list(range(200_000)))])
        sender.send(big)
        assert read_conn.poll(10), "the sender never started writing"
        for step in range(50):
            sender.send(Deltas([delta("a", [step]), delta("b", [100 + step])]))
        sender.send(Admitted("c"))  # never merged across: order matters
        for step in range(50, 80):
            sender.send(Deltas([delta("b", [100 + step])], EngineStats(num_running=step)))
        reader = MessageReader(read_conn.fileno())
        messages = read_until(reader, 4)
        sender.close()
        messages += reader.read()[0]
    finally:
        sender.close()
        read_conn.close()
        write_conn.close()
    assert len(messages) == 4, [type(m).__name__ for m in messages]
    first, before, admitted, after = messages
    assert first == big and admitted == Admitted("c")
    assert [d.request_id for d in before.deltas] == ["a", "b"]
    assert before.deltas[0].new_token_ids == list(range(50))
    assert before.deltas[1].new_token_ids == list(range(100, 150))
    assert [d.new_token_ids for d in after.deltas] == [list(range(150, 180))]
    assert after.stats == EngineStats(num_running=79)
    assert sender.failure is None


def test_sender_reports_a_closed_pipe_to_the_loop() -> None:
    read_conn, write_conn = multiprocessing.get_context("spawn").Pipe(duplex=False)
    read_conn.close()
    sender = OutputSender(write_conn)
    sender.send(Admitted("x"))
    sender.close()
    write_conn.close()
    with pytest.raises(BrokenPipeError):
        sender.check()


def test_core_loop_sends_each_request_once_per_message_in_step_order() -> None:
    """The real loop around a model-free core: all requests of a step travel together."""
    core = StreamCore(EngineConfig(model="m"))
    core.tokens_per_step = 2
    inputs: queue.Queue[Any] = queue.Queue()
    read_conn, write_conn = multiprocessing.get_context("spawn").Pipe(duplex=False)
    sender = OutputSender(write_conn)
    loop = CoreLoop(core, inputs, sender, os.getppid())
    lengths = {"r0": 5, "r1": 9, "r2": 2}
    for request_id, length in lengths.items():
        sampling = SamplingParams(max_tokens=length, logprobs=1)
        inputs.put(AddRequest(EngineRequest(request_id, [1, 2, 3], sampling)))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    reader = MessageReader(read_conn.fileno())
    messages: list[Any] = []
    tokens: dict[str, list[int]] = {r: [] for r in lengths}
    finishes: dict[str, list[FinishReason | None]] = {r: [] for r in lengths}
    try:
        deadline = time.monotonic() + 10
        while sum(f[-1:] == [FinishReason.LENGTH] for f in finishes.values()) < len(lengths):
            assert time.monotonic() < deadline, finishes
            select.select([reader.fd], [], [], 0.1)
            for message in reader.read()[0]:
                messages.append(message)
                if isinstance(message, Deltas):
                    ids = [d.request_id for d in message.deltas]
                    assert len(ids) == len(set(ids)), ids
                    for d in message.deltas:
                        assert d.logprobs is not None
                        assert [lp.token_id for lp in d.logprobs] == d.new_token_ids
                        tokens[d.request_id] += d.new_token_ids
                        finishes[d.request_id].append(d.finish_reason)
        inputs.put(Shutdown())
        thread.join(10)
    finally:
        sender.close()
        read_conn.close()
        write_conn.close()
    assert messages[:3] == [Admitted("r0"), Admitted("r1"), Admitted("r2")]
    for request_id, length in lengths.items():
        assert tokens[request_id] == list(SCRIPT[:length])
        assert finishes[request_id][-1] is FinishReason.LENGTH
        assert all(f is None for f in finishes[request_id][:-1])
    # Two tokens per step: the longest request needs five steps, so at most five messages.
    assert 1 <= sum(isinstance(m, Deltas) for m in messages) <= 5


# --- the per-request stream ---------------------------------------------------------------------


def test_request_stream_hands_over_everything_pending_then_the_error() -> None:
    async def scenario() -> None:
        stream = RequestStream("r")
        first, second = delta("r", [1]), delta("r", [2])
        stream.put(first)
        stream.put(second)
        assert await stream.take() == [first, second]
        waiting = asyncio.ensure_future(stream.take())
        await asyncio.sleep(0)
        assert not waiting.done()
        third = delta("r", [3])
        stream.put(third)
        assert await waiting == [third]
        last = delta("r", [4])
        stream.put(last)
        stream.fail(EngineDeadError("gone"))
        assert await stream.take() == [last]  # what arrived before the error comes first
        with pytest.raises(EngineDeadError, match="gone"):
            await stream.take()

    asyncio.run(scenario())


def test_sender_reports_an_unsendable_message_and_keeps_going() -> None:
    read_conn, write_conn = multiprocessing.get_context("spawn").Pipe(duplex=False)
    sender = OutputSender(write_conn)
    try:
        sender.send(Admitted(lambda: None))  # type: ignore[arg-type]  # a lambda cannot be pickled
        sender.send(Admitted("after"))
        reader = MessageReader(read_conn.fileno())
        assert read_until(reader, 1) == [Admitted("after")]
        with pytest.raises((pickle.PicklingError, AttributeError)):
            sender.check()
    finally:
        sender.close()
        read_conn.close()
        write_conn.close()
