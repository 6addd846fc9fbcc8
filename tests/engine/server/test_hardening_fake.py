"""Hostile and careless clients against the real app and core process (fake model): numbers out
of range, non-finite literals, lone surrogates, requests that can never fit, one request that
fails in the engine, oversized and slow bodies, slow headers, the API key, internal errors and
the end of a drain. Every refusal is a 4xx naming what to fix; nothing accepted is lost."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import time
from typing import Any

import httpx
import openai
import pytest

from davit_engine.server.state import ServerSettings

from .conftest import MODEL, FakeServer, serve_fake
from .fake_core import SCRIPT

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BIG = "99999999999999999999999"  # beyond int64
USER = '"messages": [{"role": "user", "content": "hi"}]'


def script(n: int) -> str:
    return "".join(SCRIPT[i % len(SCRIPT)] for i in range(n))


def post_raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


def metric_total(http: httpx.Client, prefix: str, *labels: str) -> float:
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(prefix + "{") and all(label in line for label in labels):
            total += float(line.split()[-1])
    return total


# Raw JSON text: NaN and Infinity literals, integers past int64 and lone surrogate escapes can
# only be written this way.
BAD_BODIES: list[tuple[str, str, str | None]] = [
    (COMPLETIONS, '{"prompt": "hi", "temperature": NaN}', "temperature"),
    (COMPLETIONS, '{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (COMPLETIONS, '{"prompt": "hi", "temperature": 1e38}', "temperature"),
    (COMPLETIONS, '{"prompt": "hi", "top_p": -Infinity}', "top_p"),
    (COMPLETIONS, '{"prompt": "hi", "top_p": 0.0}', "top_p"),
    (COMPLETIONS, '{"prompt": "hi", "min_p": NaN}', "min_p"),
    (COMPLETIONS, '{"prompt": "hi", "repetition_penalty": NaN}', "repetition_penalty"),
    (COMPLETIONS, '{"prompt": "hi", "repetition_penalty": 1e-320}', "repetition_penalty"),
    (COMPLETIONS, '{"prompt": "hi", "repetition_penalty": 1e300}', "repetition_penalty"),
    (COMPLETIONS, '{"prompt": "hi", "presence_penalty": 1e400}', "presence_penalty"),
    (COMPLETIONS, '{"prompt": "hi", "frequency_penalty": -Infinity}', "frequency_penalty"),
    (COMPLETIONS, f'{{"prompt": "hi", "top_k": {BIG}}}', "top_k"),
    (COMPLETIONS, '{"prompt": "hi", "top_k": 2147483648}', "top_k"),
    (COMPLETIONS, '{"prompt": "hi", "top_k": -7}', "top_k"),
    (COMPLETIONS, f'{{"prompt": "hi", "seed": {BIG}}}', "seed"),
    (COMPLETIONS, f'{{"prompt": "hi", "seed": -{BIG}}}', "seed"),
    (COMPLETIONS, f'{{"prompt": "hi", "max_tokens": {BIG}}}', "max_tokens"),
    (COMPLETIONS, f'{{"prompt": "hi", "min_tokens": {BIG}}}', "min_tokens"),
    (COMPLETIONS, f'{{"prompt": "hi", "n": {BIG}}}', "n"),
    (COMPLETIONS, f'{{"prompt": "hi", "n": -{BIG}}}', "n"),
    (COMPLETIONS, f'{{"prompt": "hi", "logprobs": {BIG}}}', "logprobs"),
    (COMPLETIONS, f'{{"prompt": "hi", "stop_token_ids": [3, {BIG}]}}', "stop_token_ids"),
    (COMPLETIONS, '{"prompt": "hi", "stop_token_ids": [-1]}', "stop_token_ids"),
    (COMPLETIONS, f'{{"prompt": [1, {BIG}]}}', "prompt"),
    (COMPLETIONS, '{"prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias"),
    (COMPLETIONS, '{"prompt": "hi", "logit_bias": {"5": 1e308}}', "logit_bias"),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 1.5}', "max_tokens"),
    (CHAT, f'{{{USER}, "logprobs": true, "top_logprobs": {BIG}}}', "top_logprobs"),
    (CHAT, f'{{{USER}, "max_completion_tokens": {BIG}}}', "max_completion_tokens"),
    (CHAT, f'{{{USER}, "temperature": NaN}}', "temperature"),
    # Lone surrogates, wherever they are.
    (COMPLETIONS, '{"prompt": "a\\ud800b"}', "prompt"),
    (COMPLETIONS, '{"prompt": ["ok", "\\udc00"]}', "prompt[1]"),
    (COMPLETIONS, '{"prompt": "hi", "stop": ["ok", "\\ud83d"]}', "stop[1]"),
    (COMPLETIONS, '{"prompt": "hi", "user": "\\udfff"}', "user"),
    (COMPLETIONS, '{"prompt": "hi", "model": "\\ud800"}', "model"),
    (COMPLETIONS, '{"prompt": "hi", "x_unknown": {"k": ["\\ud800"]}}', "x_unknown.k[0]"),
    (COMPLETIONS, '{"prompt": "hi", "\\ud800": 1}', "\\ud800"),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    (
        CHAT,
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\udbff"}]}]}',
        "messages[0].content[0].text",
    ),
    (CHAT, '{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}',
     "messages[0].name"),
]  # fmt: skip


def test_bad_numbers_and_text_are_refused_naming_the_field_while_good_work_goes_on(
    fake_server: FakeServer,
) -> None:
    client = fake_server.client()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(
            client.completions.create,
            model=MODEL,
            prompt="hi",
            max_tokens=200,
            extra_body={"ignore_eos": True},
        )
        deadline = time.monotonic() + 30
        while fake_server.state.num_in_flight == 0:  # admitted before the refusals start
            assert time.monotonic() < deadline
            time.sleep(0.005)
        with fake_server.http() as http:
            for path, text, param in BAD_BODIES:
                response = post_raw(http, path, text)
                assert response.status_code == 400, (text, response.text)
                error = response.json()["error"]
                assert error["param"] == param, (text, error)
                assert error["message"] and error["type"] == "BadRequestError"
        assert good.result(timeout=60).choices[0].text == script(200)


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 1e-45},  # below 1e-5: greedy, as upstream
        {"temperature": 5e-324},
        {"top_p": 5e-324},  # raised to 1e-10: keeps the top token
        {"top_k": -1},  # off, as upstream
        {"top_k": 2147483647},
        {"seed": 2**63 - 1},  # choice 1 wraps to -2**63 instead of overflowing
        {"repetition_penalty": 100.0, "presence_penalty": 2.0, "frequency_penalty": -2.0},
    ],
)
def test_values_at_the_edges_are_served(fake_server: FakeServer, extra: dict[str, Any]) -> None:
    with fake_server.http() as http:
        body = {"prompt": "hi", "max_tokens": 3, "n": 2, **extra}
        response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2


def test_requests_that_can_never_fit_are_400_not_429() -> None:
    with serve_fake(step_s=0.005, max_num_seqs=2, max_queue_len=1) as server, server.http() as http:
        too_many = http.post(COMPLETIONS, json={"prompt": "hi", "n": 4, "max_tokens": 2})
        assert too_many.status_code == 400, too_many.text
        error = too_many.json()["error"]
        assert error["param"] == "n"
        assert "--max-num-seqs 2" in error["message"] and "--max-queue-len 1" in error["message"]
        prompts = http.post(COMPLETIONS, json={"prompt": ["a", "b", "c", "d"]})
        assert prompts.status_code == 400 and prompts.json()["error"]["param"] == "prompt"
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 5}
        assert http.post(CHAT, json=chat).json()["error"]["param"] == "n"
        long_prompt = http.post(COMPLETIONS, json={"prompt": "x" * 1000})
        assert long_prompt.status_code == 400
        assert long_prompt.json()["error"]["param"] == "prompt"
        assert "maximum context length" in long_prompt.json()["error"]["message"]
        fits = http.post(COMPLETIONS, json={"prompt": "hi", "n": 3, "max_tokens": 2})
        assert fits.status_code == 200, fits.text


def test_a_request_that_fails_in_the_engine_fails_alone(fake_server: FakeServer) -> None:
    client = fake_server.client()
    with fake_server.http() as http:
        errors_before = metric_total(http, "vllm:request_success_total", 'finished_reason="error"')

    def good(i: int) -> str:
        stream = client.completions.create(
            model=MODEL, prompt=f"fine {i}", max_tokens=40, stream=True
        )
        return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    with concurrent.futures.ThreadPoolExecutor(4) as pool, fake_server.http() as http:
        goods = [pool.submit(good, i) for i in range(3)]
        time.sleep(0.05)
        # Non-streamed: 500 with a message, no traceback.
        response = http.post(COMPLETIONS, json={"prompt": "CRASH here", "max_tokens": 40})
        assert response.status_code == 500, response.text
        message = response.json()["error"]["message"]
        assert "failed while running this request" in message and "RuntimeError" in message
        assert "Traceback" not in response.text and ".py" not in response.text
        # Streamed: a last chunk with finish reason "error", an error event, then [DONE].
        body = {"prompt": "CRASH again", "max_tokens": 40, "stream": True}
        with http.stream("POST", COMPLETIONS, json=body) as stream:
            assert stream.status_code == 200
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 500 and "failed while running this request" in error["message"]
        last_chunk = json.loads(events[-3].removeprefix("data: "))
        assert last_chunk["choices"][0]["finish_reason"] == "error"
        assert [g.result(timeout=60) for g in goods] == [script(40)] * 3
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200
        errors_after = metric_total(http, "vllm:request_success_total", 'finished_reason="error"')
    assert errors_after - errors_before == 2
    stats = fake_server.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_bodies_over_the_limit_get_413_and_are_counted() -> None:
    settings = ServerSettings(max_request_body_bytes=10_000)
    with serve_fake(step_s=0.005, settings=settings) as server, server.http() as http:
        before = metric_total(http, "http_requests_total", 'status="413"')
        declared = http.post(COMPLETIONS, json={"prompt": "x" * 20_000})
        assert declared.status_code == 413, declared.text
        error = declared.json()["error"]
        assert "10000 bytes" in error["message"] and "--max-request-body-bytes" in error["message"]

        def chunks() -> Any:  # no Content-Length: the limit counts what arrives
            yield b'{"prompt": "'
            for _ in range(30):
                yield b"y" * 1000
            yield b'"}'

        chunked = http.post(
            COMPLETIONS, content=chunks(), headers={"content-type": "application/json"}
        )
        assert chunked.status_code == 413
        small = http.post(COMPLETIONS, json={"prompt": "x" * 100, "max_tokens": 2})
        assert small.status_code == 200
        assert metric_total(http, "http_requests_total", 'status="413"') - before == 2


def _closed_within(sock: socket.socket, timeout_s: float) -> tuple[bool, bytes]:
    """Whether the server closed `sock` within `timeout_s`, and what it sent before."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        return False, received
    except ConnectionResetError:
        pass
    return True, received


def test_slow_clients_are_dropped_and_others_are_served() -> None:
    timeout = 1.0
    settings = ServerSettings(request_read_timeout_s=timeout)
    with serve_fake(step_s=0.005, settings=settings) as server:
        port = int(server.base_url.rsplit(":", 1)[1])
        with server.http() as http:
            before = metric_total(http, "http_requests_total", 'status="408"')

        def connect() -> socket.socket:
            return socket.create_connection(("127.0.0.1", port), timeout=5)

        silent = connect()  # connects and sends nothing
        trickling = connect()  # sends a header byte now and then, never the end of the head
        trickling.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        slow_body = connect()  # a complete head, then a body that never completes
        slow_body.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        started = time.monotonic()
        for _ in range(4):
            time.sleep(timeout / 4)
            trickling.sendall(b"X")
        with server.http() as http:  # meanwhile the server serves others
            assert http.get("/health").status_code == 200
        grace = timeout * 3 + 2.0
        for sock in (silent, trickling):
            closed, _ = _closed_within(sock, grace)
            assert closed, "a client that never finished its request head was not dropped"
        closed, received = _closed_within(slow_body, grace)
        assert closed and received.startswith(b"HTTP/1.1 408"), received[:200]
        assert b"did not arrive within" in received
        assert time.monotonic() - started < timeout + grace
        for sock in (silent, trickling, slow_body):
            sock.close()
        with server.http() as http:
            assert metric_total(http, "http_requests_total", 'status="408"') - before == 1
            response = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 3})
            assert response.json()["choices"][0]["text"] == script(3)


def test_the_api_key_guards_every_route_but_probes_and_metrics() -> None:
    key = "s3cret-key"
    with serve_fake(step_s=0.005, settings=ServerSettings(api_key=key)) as server:
        base = f"{server.base_url}/v1"
        wrong = openai.OpenAI(base_url=base, api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as denied:
            wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert denied.value.status_code == 401
        right = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
        reply = right.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert reply.choices[0].text == script(3)
        with server.http() as http:
            for path in ("/health", "/ready", "/metrics"):
                assert http.get(path).status_code == 200, path
            for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("GET", "/docs")):
                response = http.request(method, path, json={})
                assert response.status_code == 401, (path, response.text)
                assert response.headers["www-authenticate"] == "Bearer"
            no_scheme = http.get("/v1/models", headers={"Authorization": key})
            assert no_scheme.status_code == 401
            assert key not in no_scheme.text
            ok = http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200
            # The refusals are counted like any other answer.
            assert metric_total(http, "http_requests_total", 'status="401"') >= 5


def test_an_unexpected_error_is_a_counted_500_without_internals() -> None:
    with serve_fake(step_s=0.005) as server, server.http() as http:
        tokenizer = server.state.tokenizer
        server.state.set_tokenizer(object())  # type: ignore[arg-type]  # breaks preparation
        try:
            response = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})
        finally:
            server.state.set_tokenizer(tokenizer)
        assert response.status_code == 500
        message = response.json()["error"]["message"]
        assert "AttributeError" in message and "server log" in message
        assert "Traceback" not in response.text and ".py" not in response.text
        assert metric_total(http, "http_requests_total", 'handler="/v1/completions"',
                            'status="500"') == 1  # fmt: skip
        assert http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_the_drain_timeout_ends_open_requests_with_a_reason() -> None:
    with serve_fake(step_s=0.02) as server, server.http() as http:
        loop = server.state.client._loop  # type: ignore[attr-defined]  # the server's loop
        body = {"prompt": "hi", "max_tokens": 250, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            plain = pool.submit(
                lambda: httpx.post(f"{server.base_url}{COMPLETIONS}", json=body, timeout=60)
            )
            with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as stream:
                lines = stream.iter_lines()
                events = [next(line for line in lines if line.startswith("data: "))]
                deadline = time.monotonic() + 30
                while server.state.num_in_flight < 2:
                    assert time.monotonic() < deadline, "the plain request was never admitted"
                    time.sleep(0.01)
                drained = asyncio.run_coroutine_threadsafe(server.state.drain(0.3), loop)
                events += [line for line in lines if line.startswith("data: ")]
            assert drained.result(timeout=30) is False
            response = plain.result(timeout=30)
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "drain timeout" in error["message"]
        finish = json.loads(events[-3].removeprefix("data: "))["choices"][0]["finish_reason"]
        assert finish == "abort"
        assert response.status_code == 503 and "drain timeout" in response.text
        assert server.state.num_in_flight == 0
