"""The HTTP front end and the engine-core process, with the fake core (fast, no model).

The app, the uvicorn server, the core process, the pipes and the real scheduler all run; only
the model is replaced (see fake_core.py). Outputs are therefore known exactly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import threading
import time
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from davit_engine.config import EngineConfig
from davit_engine.server.app import create_app

from .conftest import MODEL, FakeServer, serve_fake
from .fake_core import SCRIPT
from .harness import free_port


def script(n: int, seed: int | None = None) -> str:
    offset = 0 if seed is None else seed % len(SCRIPT)
    return "".join(SCRIPT[(i + offset) % len(SCRIPT)] for i in range(n))


def wait_idle(server: FakeServer, timeout_s: float = 10.0) -> dict[str, object]:
    """Stats once no request runs, waits or is open in the front end."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.stats()
        if (
            stats["num_running"] == 0
            and stats["num_waiting"] == 0
            and not server.state.num_in_flight
        ):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {stats}")
        time.sleep(0.05)


def test_chat_completion_text_usage_and_finish(fake_server: FakeServer) -> None:
    reply = fake_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12
    )
    assert reply.choices[0].message.content == script(12)
    assert reply.choices[0].finish_reason == "length"
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt.encode())
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_chat_content_parts_are_joined(fake_server: FakeServer) -> None:
    with fake_server.http() as http:
        response = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_tokens": 3,
            },
        )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == script(3)


def test_several_prompts_and_n_give_indexed_choices(fake_server: FakeServer) -> None:
    reply = fake_server.client().completions.create(
        model=MODEL, prompt=["hi", "hello"], n=2, seed=1, max_tokens=4
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    # Choice j of a prompt samples with seed + j: different, yet reproducible.
    assert [c.text for c in reply.choices] == [script(4, 1), script(4, 2)] * 2
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(b"hi") + len(b"hello")
    assert reply.usage.completion_tokens == 16


def test_streaming_chat_with_n_merges_choices(fake_server: FakeServer) -> None:
    chunks = list(
        fake_server.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            n=3,
            seed=0,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {j: script(5, j) for j in range(3)}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 15


def test_completion_with_token_id_prompt(fake_server: FakeServer) -> None:
    reply = fake_server.client().completions.create(model=MODEL, prompt=[72, 105], max_tokens=5)
    assert reply.choices[0].text == script(5)
    assert reply.usage is not None and reply.usage.prompt_tokens == 2


def test_streaming_chat_with_usage(fake_server: FakeServer) -> None:
    stream = fake_server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == script(9)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 9


def test_streaming_completion_ends_with_done(fake_server: FakeServer) -> None:
    with (
        fake_server.http() as http,
        http.stream(
            "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}
        ) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == script(4)
    # At most one event per token (queued tokens may be merged), no usage unless asked for.
    assert 1 <= len(chunks) <= 4 and all(c["usage"] is None for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_output_and_frees_the_request(
    fake_server: FakeServer, stream: bool
) -> None:
    client = fake_server.client()
    if stream:
        chunks = list(
            client.completions.create(
                model=MODEL, prompt="hi", max_tokens=40, stop=["brown", "lazy"], stream=True
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        reply = client.completions.create(
            model=MODEL, prompt="hi", max_tokens=40, stop=["brown", "lazy"]
        )
        text, finish = reply.choices[0].text, reply.choices[0].finish_reason
    assert text == "The quick "
    assert finish == "stop"
    # Only the front end knows about stop strings: it must have aborted the request in the core.
    stats = wait_idle(fake_server)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_include_stop_str_in_output(fake_server: FakeServer) -> None:
    with fake_server.http() as http:
        response = http.post(
            "/v1/completions",
            json={
                "prompt": "hi",
                "max_tokens": 40,
                "stop": "quick",
                "include_stop_str_in_output": True,
            },
        )
    assert response.json()["choices"][0]["text"] == "The quick"


def test_seed_selects_a_reproducible_output(fake_server: FakeServer) -> None:
    client = fake_server.client()

    def run(seed: int) -> str:
        reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=8, seed=seed)
        return reply.choices[0].text

    assert run(4) == run(4) == script(8, seed=4)
    assert run(5) != run(4)


def test_chat_logprobs_format(fake_server: FakeServer) -> None:
    reply = fake_server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [entry.token for entry in logprobs.content] == list(script(4))
    for entry in logprobs.content:
        assert entry.logprob == -0.25
        assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == [-0.25, -1.5]
        assert entry.top_logprobs[0].token == entry.token


def test_completion_logprobs_format(fake_server: FakeServer) -> None:
    reply = fake_server.client().completions.create(
        model=MODEL, prompt="hi", max_tokens=3, logprobs=1
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == list(script(3))
    assert logprobs.token_logprobs == [-0.25] * 3
    assert logprobs.top_logprobs == [{token: -0.25} for token in script(3)]
    assert logprobs.text_offset == [0, 1, 2]


def test_models_health_ready_and_info(fake_server: FakeServer) -> None:
    with fake_server.http() as http:
        models = http.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert models["data"][0]["max_model_len"] == 256
        assert http.get("/health").status_code == 200
        assert http.get("/ready").json() == {"ready": True}
        info = http.get("/v1/engine/info").json()
    assert info["model_info"]["runner"] == "fake"
    assert info["model_info"]["eos_token_ids"] == [257]


def test_metrics_names_and_counts(fake_server: FakeServer) -> None:
    client = fake_server.client()
    client.completions.create(model=MODEL, prompt="hello", max_tokens=5)
    with fake_server.http() as http:
        text = http.get("/metrics").text
    label = f'model_name="{MODEL}"'
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert any(line.startswith(name + "{") and label in line for line in text.splitlines()), (
            name
        )
    success = [line for line in text.splitlines() if line.startswith("vllm:request_success_total")]
    assert any(
        'finished_reason="length"' in line and float(line.split()[-1]) >= 1 for line in success
    )


# --- bad input ------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (COMPLETIONS, b'{"prompt": "hi", ', 400, None),
        (COMPLETIONS, b"\xff\xfe{}", 400, None),
        (COMPLETIONS, b"[1, 2]", 400, None),
        (COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
        (COMPLETIONS, {"prompt": 5}, 400, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
        (COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        (COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n"),
        (COMPLETIONS, {"prompt": ["a", "b"], "n": 100}, 400, "n"),
        (COMPLETIONS, {"prompt": ["a", ""]}, 400, "prompt[1]"),
        (COMPLETIONS, {"prompt": [[1, 2], [3, 100000]]}, 400, "prompt[1]"),
        (COMPLETIONS, {"prompt": ["a"] * 65}, 400, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
        (COMPLETIONS, {"prompt": "x" * 300}, 400, "prompt"),
        (COMPLETIONS, {"prompt": [1, 100000]}, 400, "prompt"),
        (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "stop": ""}, 400, "stop"),
        (COMPLETIONS, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        (CHAT, {"messages": []}, 400, "messages"),
        (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 10}}, 400, "logit_bias"),
        (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
        (CHAT, {"messages": USER, "response_format": {"type": "json_object"}}, 400,
         "response_format"),
        (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
        (CHAT, {"messages": "hi"}, 400, "messages"),
        (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        (CHAT, {"messages": USER, "stream_options": {"include_usage": "yes"}}, 400,
         "stream_options.include_usage"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "messages[0].content[0].type",
        ),
    ],
)  # fmt: skip
def test_bad_input_gets_an_openai_error_naming_the_field(
    fake_server: FakeServer, path: str, body: object, status: int, param: str | None
) -> None:
    with fake_server.http() as http:
        if isinstance(body, bytes):
            response = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"]
    if param is not None:
        assert param.split(".")[0].split("[")[0] in error["message"]


def test_bad_input_does_not_disturb_a_running_request(fake_server: FakeServer) -> None:
    client = fake_server.client()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(
            client.completions.create,
            model=MODEL,
            prompt="hi",
            max_tokens=30,
            extra_body={"ignore_eos": True},
        )
        with fake_server.http() as http:
            for body in (b"{", b'{"prompt": 1}', b'{"prompt": "hi", "temperature": -1}'):
                response = http.post(
                    COMPLETIONS, content=body, headers={"content-type": "application/json"}
                )
                assert response.status_code == 400
        assert good.result(timeout=30).choices[0].text == script(30)


# --- disconnects, overload, crash, drain ------------------------------------------------------


def test_client_disconnects_abort_and_free_every_block() -> None:
    with serve_fake(step_s=0.01, max_num_seqs=4) as server:

        async def one(http: httpx.AsyncClient, i: int) -> None:
            body: dict[str, object] = {
                "prompt": f"request {i}",
                "max_tokens": 200,
                "ignore_eos": True,
            }
            if i % 2:
                # Streaming: leave after 1-3 events, so the request surely ran in the core.
                body["stream"] = True
                async with http.stream("POST", COMPLETIONS, json=body) as response:
                    events = 0
                    async for line in response.aiter_lines():
                        events += line.startswith("data: ")
                        if events == 1 + i % 3:
                            return
                raise AssertionError("the stream ended before the client left")
            # Not streaming: leave at some moment, maybe before the server even saw it.
            task = asyncio.ensure_future(http.post(COMPLETIONS, json=body))
            await asyncio.sleep(0.05 + (i % 5) * 0.04)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        async def run() -> None:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30.0) as http:
                await asyncio.gather(*(one(http, i) for i in range(20)))

        asyncio.run(run())
        stats = wait_idle(server)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert server.state.num_in_flight == 0
        with server.http() as http:
            metrics = http.get("/metrics").text
        aborted = [
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line
        ]
        # Every stream left mid-way; a request cancelled before the server read it never
        # started, so of the others only some count.
        assert len(aborted) == 1 and 10 <= aborted[0] <= 20, aborted


def test_full_queue_answers_429_and_accepted_requests_complete() -> None:
    with serve_fake(step_s=0.02, max_num_seqs=1, max_queue_len=1) as server:
        client = server.client()

        def call(i: int) -> str | openai.RateLimitError:
            """The completion text; streaming for odd i (refused before the stream starts)."""
            kwargs: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 15}
            kwargs["extra_body"] = {"ignore_eos": True}
            try:
                if i % 2:
                    chunks = client.completions.create(stream=True, **kwargs)
                    return "".join(c.choices[0].text for c in chunks if c.choices)
                return client.completions.create(**kwargs).choices[0].text
            except openai.RateLimitError as exc:
                return exc

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(call, range(8)))
        rejected = [r for r in results if isinstance(r, openai.RateLimitError)]
        accepted = [r for r in results if not isinstance(r, openai.RateLimitError)]
        assert rejected and accepted
        # With at most three accepted, some streaming request was refused too.
        if len(accepted) <= 3:
            assert any(isinstance(r, openai.RateLimitError) for r in results[1::2])
        for exc in rejected:
            assert exc.status_code == 429
            assert exc.response.headers["content-type"] == "application/json"
            assert int(exc.response.headers["Retry-After"]) >= 1
        assert accepted == [script(15)] * len(accepted)


def test_crashed_core_fails_requests_and_health() -> None:
    with serve_fake(step_s=0.01) as server, server.http() as http:
        # Streaming: the stream had started, so the error arrives as an event, then [DONE].
        body = {"prompt": "FATAL now", "max_tokens": 5, "stream": True}
        with http.stream("POST", COMPLETIONS, json=body) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
        assert "failed on purpose" in error["message"]
        response = http.post(COMPLETIONS, json={"prompt": "FATAL now", "max_tokens": 5})
        assert response.status_code == 503, response.text
        assert "failed on purpose" in response.json()["error"]["message"]
        health = http.get("/health")
        assert health.status_code == 503
        assert http.get("/ready").status_code == 503
        after = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 5})
        assert after.status_code == 503
        # The log keeps the traceback; no answer shows one, or a file path.
        for text in (error["message"], response.text, health.text, after.text):
            assert "Traceback" not in text and "/opt/davit" not in text and ".py" not in text


def test_killed_core_ends_streams_with_its_exit_code() -> None:
    """No goodbye message: the pipe's end (and the process sentinel) tell the client."""
    with serve_fake(step_s=0.01) as server, server.http() as http:
        body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with http.stream("POST", COMPLETIONS, json=body) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if len(events) == 1:
                    core_pid = server.state.client.core_pid  # type: ignore[attr-defined]
                    os.kill(core_pid, signal.SIGKILL)
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503
        assert f"exit code {-signal.SIGKILL}" in error["message"]
        assert http.get("/health").status_code == 503
        assert server.state.num_in_flight == 0


def test_drain_refuses_new_requests_and_finishes_in_flight() -> None:
    with serve_fake(step_s=0.02) as server:
        client = server.client()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(
                client.completions.create,
                model=MODEL,
                prompt="hi",
                max_tokens=40,
                extra_body={"ignore_eos": True},
            )
            deadline = time.monotonic() + 10
            while server.state.num_in_flight == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            server.state.begin_drain()
            with server.http() as http:
                assert http.get("/ready").status_code == 503
                refused = http.post(COMPLETIONS, json={"prompt": "hi"})
                assert refused.status_code == 503
                assert "shutting down" in refused.json()["error"]["message"]
            assert in_flight.result(timeout=30).choices[0].text == script(40)
        assert server.state.num_in_flight == 0


def test_a_core_that_fails_to_load_is_reported_not_hung() -> None:
    from .conftest import byte_tokenizer
    from .fake_core import __name__ as fake_module

    reasons: list[str] = []
    app = create_app(
        EngineConfig(model=MODEL, max_model_len=99),
        core_factory=f"{fake_module}:failing_core",
        tokenizer_loader=byte_tokenizer,
        on_fatal=reasons.append,
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not reasons:
            assert time.monotonic() < deadline, "the load failure was never reported"
            time.sleep(0.05)
        assert reasons == ["--max-model-len: 99 exceeds the model's 8 positions"]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            health = http.get("/health")
            assert health.status_code == 503
            assert "--max-model-len" in health.json()["error"]["message"]
            assert http.get("/ready").status_code == 503
            refused = http.post(COMPLETIONS, json={"prompt": "hi"})
            assert refused.status_code == 503
    finally:
        server.should_exit = True
        thread.join(30)
