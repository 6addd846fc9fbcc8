"""One admitted generation request, from admission to its last piece, shared by both routes.

Lifecycle contract: `admit()` either raises an OpenAIError (nothing is left in the core) or
returns a `Generation` that the caller must `close()` exactly when it stops caring (normally
after the last piece; also on client disconnect). `close()` aborts the request in the core if it
had not finished, which frees its KV blocks, and records the request's metrics.

A generation ends early with an OpenAIError from `pieces()`: 503 when the core died, 500 when
the core failed this request alone (after a last piece with finish reason "error"), 503 when
the server cut it off at the end of a drain (after a last piece with finish reason "abort").
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from davit_engine.ipc.errors import AdmissionError, EngineDeadError
from davit_engine.ipc.messages import merge_deltas
from davit_engine.ipc.request_stream import RequestStream
from davit_engine.output.processor import OutputPiece, OutputProcessor
from davit_engine.server.errors import OpenAIError
from davit_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from davit_engine.types import (
    INT64_MAX,
    INT64_MIN,
    EngineRequest,
    FinishReason,
    RequestDelta,
    SamplingParams,
)

if TYPE_CHECKING:
    from davit_engine.server.state import ServerState


class RequestCutOff(Exception):
    """The server ended the request before it finished (its message says why)."""


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: seed + index, wrapped to stay a 64-bit signed integer."""
    span = INT64_MAX - INT64_MIN + 1
    return (seed + index - INT64_MIN) % span + INT64_MIN


class Generation:
    """An admitted request: its deltas become `OutputPiece`s through `pieces()`."""

    def __init__(
        self,
        state: ServerState,
        request_id: str,
        stream: RequestStream,
        output: OutputProcessor,
        arrival: float,
        index: int = 0,
        prompt_index: int = 0,
    ) -> None:
        self.state = state
        self.index = index  # the choice's index in the response
        self.prompt_index = prompt_index  # which prompt of the request it continues
        self.request_id = request_id
        self.stream = stream
        self.output = output
        self.arrival = arrival
        self.created = int(time.time())
        self._first_token_at: float | None = None
        self._last_output_at: float | None = None
        self._closed = False

    async def pieces(self) -> AsyncIterator[OutputPiece]:
        """Yield pieces until the request finishes. Raises OpenAIError(503) if the core dies.

        Every piece holds all the deltas that arrived since the previous one, processed as one
        (one detokenization, one stop-string check, one metrics update): a consumer that falls
        behind (a slow client, a loaded API process) catches up with fewer, larger pieces
        instead of falling further behind.
        """
        while not self.output.finished:
            try:
                deltas = await self.stream.take()
            except EngineDeadError as exc:
                raise OpenAIError(503, f"the engine stopped: {exc}") from exc
            except RequestCutOff as exc:
                yield OutputPiece("", 0, finish_reason=FinishReason.ABORT.value)
                raise OpenAIError(503, str(exc)) from exc
            delta = merge_deltas(deltas)
            yield self._process(delta)
            if delta.finish_reason is FinishReason.ERROR:
                raise OpenAIError(
                    500, f"the engine failed while running this request: {delta.error}"
                )

    def cut_off(self, reason: str) -> None:
        """End `pieces()` early with RequestCutOff(reason) (after the deltas already here)."""
        self.stream.fail(RequestCutOff(reason))

    def _process(self, delta: RequestDelta) -> OutputPiece:
        metrics = self.state.metrics
        now = time.monotonic()
        if delta.new_token_ids:
            if self._first_token_at is None:
                self._first_token_at = now
                metrics.time_to_first_token.observe(now - self.arrival)
                metrics.prompt_tokens.inc(delta.num_prompt_tokens or self.output.num_prompt_tokens)
            elif self._last_output_at is not None:
                metrics.inter_token_latency.observe(now - self._last_output_at)
            self._last_output_at = now
            metrics.generation_tokens.inc(len(delta.new_token_ids))
        piece = self.output.process(delta)
        if piece.stopped_by_string:
            # The core would keep generating: only the front end knows about stop strings.
            self.state.client.abort(self.request_id)
        elif delta.finished:
            self.state.client.release(self.request_id)
        return piece

    def close(self) -> None:
        """Abort the request if it is unfinished; record its metrics. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.state.untrack(self)
        self.state.end_request()
        metrics = self.state.metrics
        if not self.output.finished:
            self.state.client.abort(self.request_id)
            metrics.request_finished("abort")  # the client left before the end
            return
        metrics.request_finished(self.output.finish_reason or "stop")
        end = self._last_output_at or time.monotonic()
        metrics.e2e_request_latency.observe(end - self.arrival)

    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, cached prompt tokens)."""
        out = self.output
        return out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens


async def admit(
    state: ServerState,
    prompt_token_ids: list[int],
    sampling: SamplingParams,
    prefix: str,
    client_param: Callable[[str], str],
    index: int = 0,
    prompt_index: int = 0,
) -> Generation:
    """Send a tokenized, validated request to the core and wait for its admission answer.

    A refusal naming a field is a 400 naming it as `client_param` maps it to the body's field.
    """
    state.check_accepting()
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    arrival = time.monotonic()
    output = OutputProcessor(state.tokenizer, prompt_token_ids, sampling)
    request = EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        arrival_time=time.time(),
        eos_token_ids=state.eos_token_ids,
    )
    state.begin_request()
    try:
        stream = await state.client.add_request(request)
    except AdmissionError as exc:
        state.end_request()
        rejection = exc.rejection
        if rejection.kind == "queue_full":
            retry_after = max(1, math.ceil(rejection.retry_after_s or 1.0))
            raise OpenAIError(
                429, rejection.message, None, {"Retry-After": str(retry_after)}
            ) from exc
        if rejection.kind == "param":
            # The core names its own fields ("prompt" for what a chat client sent as "messages").
            param = None if rejection.param is None else client_param(rejection.param)
            raise OpenAIError(400, rejection.message, param) from exc
        raise OpenAIError(500, rejection.message) from exc
    except EngineDeadError as exc:
        state.end_request()
        raise OpenAIError(503, f"the engine is not running: {exc}") from exc
    except BaseException:
        state.end_request()
        raise
    generation = Generation(state, request_id, stream, output, arrival, index, prompt_index)
    state.track(generation)
    return generation


class Choices:
    """All generations of one HTTP request (several prompts, or `n` > 1), as one unit.

    `close()` closes every generation; `pieces()` merges their pieces as they come, tagged with
    the generation they belong to.
    """

    def __init__(self, generations: list[Generation]) -> None:
        assert generations, "a response needs at least one choice"
        self.generations = generations
        self.id = generations[0].request_id
        self.created = generations[0].created

    def close(self) -> None:
        for generation in self.generations:
            generation.close()

    async def pieces(self) -> AsyncIterator[tuple[Generation, OutputPiece]]:
        if len(self.generations) == 1:
            generation = self.generations[0]
            async for piece in generation.pieces():
                yield generation, piece
            return
        merged: asyncio.Queue[tuple[Generation, OutputPiece] | BaseException | None] = (
            asyncio.Queue()
        )

        async def pump(generation: Generation) -> None:
            try:
                async for piece in generation.pieces():
                    merged.put_nowait((generation, piece))
            except OpenAIError as exc:
                merged.put_nowait(exc)
            finally:
                merged.put_nowait(None)

        tasks = [asyncio.ensure_future(pump(g)) for g in self.generations]
        try:
            remaining = len(tasks)
            while remaining:
                item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, cached prompt tokens); each prompt counts once."""
        prompt = completion = cached = 0
        seen: set[int] = set()
        for generation in self.generations:
            p, c, k = generation.usage_counts()
            completion += c
            if generation.prompt_index not in seen:
                seen.add(generation.prompt_index)
                prompt += p
                cached += k
        return prompt, completion, cached


async def admit_choices(
    state: ServerState,
    body: ChatCompletionRequest | CompletionRequest,
    prompts: list[list[int]],
    samplings: list[SamplingParams],
    prefix: str,
) -> Choices:
    """Admit `body.n` generations per prompt (choice index = prompt index * n + j), or none at
    all.

    With a seed, choice j samples with seed + j (wrapped to 64 bits), so choices differ yet
    stay reproducible. Raises ParamError when the choices could never all be admitted.
    """
    n = body.n
    state.check_capacity(len(prompts) * n, "n" if n > 1 else "prompt")
    admitted: list[Generation] = []
    try:
        for prompt_index, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
            for j in range(n):
                seeded = sampling
                if j and sampling.seed is not None:
                    seeded = dataclasses.replace(sampling, seed=choice_seed(sampling.seed, j))
                index = prompt_index * n + j
                admitted.append(
                    await admit(
                        state, prompt, seeded, prefix, body.client_param, index, prompt_index
                    )
                )
    except BaseException:
        for generation in admitted:
            generation.close()
        raise
    return Choices(admitted)
