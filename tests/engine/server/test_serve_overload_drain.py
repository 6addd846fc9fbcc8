"""`davit serve` on the reference model under a tiny queue, then drained with SIGTERM."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .harness import ServeProcess, smollm2_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    log = Path(tmp_path_factory.mktemp("serve")) / "serve.log"
    args = [str(smollm2_gguf()), "--dtype", "float32", "--max-model-len", "512"]
    args += ["--num-gpu-blocks-override", "128", "--max-queue-len", "2", "--max-num-seqs", "1"]
    args += ["--drain-timeout", "120"]
    proc = ServeProcess(args, log)
    try:
        proc.wait_ready()
        yield proc
    finally:
        code = proc.terminate()
        assert code == 0, f"davit serve exited {code}\n{proc.log()}"


def test_overload_gets_429_and_every_accepted_request_completes(server: ServeProcess) -> None:
    def call(i: int) -> httpx.Response:
        body = {"prompt": f"Count to {i}:", "max_tokens": 12, "ignore_eos": True}
        return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(call, range(8)))
    accepted = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    assert len(accepted) + len(rejected) == 8, [r.text for r in responses]
    # One runs and two wait; with all eight sent at once the rest must be refused.
    assert len(accepted) >= 3 and len(rejected) >= 1, [r.status_code for r in responses]
    for response in rejected:
        assert int(response.headers["Retry-After"]) >= 1
        error = response.json()["error"]
        assert error["code"] == 429 and "queue" in error["message"]
    for response in accepted:
        body = response.json()
        assert body["usage"]["completion_tokens"] == 12
        assert body["choices"][0]["finish_reason"] == "length"


def test_sigterm_drains_in_flight_requests_then_exits_zero(server: ServeProcess) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.base_url, timeout=300) as http,
        http.stream("POST", "/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"]

        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while http.get("/ready").status_code != 503:
            assert time.monotonic() < deadline, "/ready did not turn 503 after SIGTERM"
            time.sleep(0.05)
        refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert "shutting down" in refused.json()["error"]["message"]

        events = [first] + [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(60) == 0
