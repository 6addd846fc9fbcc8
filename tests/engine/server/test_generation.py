"""Generation: turning queued deltas into pieces, merging what queued up, closing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from davit_engine.config import EngineConfig
from davit_engine.ipc.errors import EngineDeadError
from davit_engine.ipc.request_stream import RequestStream
from davit_engine.output.processor import OutputProcessor
from davit_engine.server.errors import OpenAIError
from davit_engine.server.generation import Generation
from davit_engine.server.state import ServerSettings, ServerState
from davit_engine.tokenizer import ByteTokenizer
from davit_engine.types import FinishReason, RequestDelta, SamplingParams


@dataclass
class RecordingClient:
    """Records what the generation tells the engine client (a narrow stand-in)."""

    aborted: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    model_info: dict[str, object] = field(default_factory=dict)
    dead_reason: str | None = None
    latest_stats: None = None
    is_alive: bool = True

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def make_generation(
    sampling: SamplingParams, deltas: list[RequestDelta | EngineDeadError]
) -> tuple[Generation, RecordingClient]:
    client = RecordingClient()
    state = ServerState(EngineConfig(model="m"), ServerSettings(), client, None)  # type: ignore[arg-type]
    state.begin_request()
    stream = RequestStream("r1")
    for item in deltas:
        if isinstance(item, EngineDeadError):
            stream.fail(item)
        else:
            stream.put(item)
    tokenizer = ByteTokenizer(512, None, (257,))
    output = OutputProcessor(tokenizer, list(b"hi"), sampling)
    return Generation(state, "r1", stream, output, 0.0), client


def delta(text: str, finish: FinishReason | None = None) -> RequestDelta:
    return RequestDelta("r1", list(text.encode()), finish_reason=finish, num_prompt_tokens=2)


async def collect(generation: Generation) -> list[tuple[str, str | None]]:
    return [(p.text, p.finish_reason) async for p in generation.pieces()]


def test_queued_deltas_merge_into_one_piece() -> None:
    generation, client = make_generation(
        SamplingParams(), [delta("ab"), delta("c"), delta("d", FinishReason.LENGTH)]
    )
    assert asyncio.run(collect(generation)) == [("abcd", "length")]
    assert client.released == ["r1"] and client.aborted == []
    generation.close()
    assert generation.state.num_in_flight == 0 and client.aborted == []


def test_stop_string_aborts_in_the_core_and_ends_the_pieces() -> None:
    generation, client = make_generation(
        SamplingParams(stop=("cd",)), [delta("abc"), delta("def"), delta("g")]
    )
    assert asyncio.run(collect(generation)) == [("ab", "stop")]
    assert client.aborted == ["r1"]


def test_close_before_the_end_aborts_once() -> None:
    generation, client = make_generation(SamplingParams(), [delta("a")])
    generation.close()
    generation.close()
    assert client.aborted == ["r1"] and generation.state.num_in_flight == 0


def test_dead_engine_becomes_503() -> None:
    generation, _ = make_generation(SamplingParams(), [delta("a"), EngineDeadError("gone")])
    with pytest.raises(OpenAIError) as error:
        asyncio.run(collect(generation))
    assert error.value.status_code == 503 and "gone" in error.value.message
