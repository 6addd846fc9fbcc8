"""The OpenAI-compatible server over runner V2 with asynchronous scheduling (tiny random Qwen3 on
the CPU), with a fault that one request's prompt triggers inside the engine-core process.

Through the official `openai` client: the poisoned request fails with a 500 naming the error,
concurrent requests answer exactly what they answer alone, and the server keeps serving. With a
fault after which the device runs no more work, the core stops: `/health` answers 503 with a
message naming the device error.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.engine_core import EngineCore
from davit_engine.server.app import create_app
from tests.engine.test_isolating_runner import POISON
from tests.engine.test_isolating_runner_v2 import Fault, v2_core

from .harness import threaded_server

pytestmark = pytest.mark.slow

MODEL = "tiny-v2"
STICKY = "CUDA error: an illegal memory access was encountered"


def faulty_core(config: EngineConfig) -> EngineCore:
    """The engine core with the fault installed (built inside the spawned core process)."""
    core = v2_core(config)
    Fault("sample", after=2).install(pytest.MonkeyPatch())
    return core


def broken_device_core(config: EngineConfig) -> EngineCore:
    """A core whose device runs no more work once the fault fired (as after an illegal memory
    access: every CUDA call the device check makes fails)."""
    core = v2_core(config)
    patch = pytest.MonkeyPatch()
    fault = Fault("sample", after=2, error=RuntimeError(STICKY))
    fault.install(patch)
    check = fault.check
    broken: list[bool] = []

    def check_and_break(place: str, scheduled: Any) -> None:
        try:
            check(place, scheduled)
        except RuntimeError:
            broken.append(True)
            raise

    def synchronize(*_: Any) -> None:
        if broken:
            raise RuntimeError(STICKY)

    patch.setattr(fault, "check", check_and_break)
    patch.setattr(torch.cuda, "is_available", lambda: bool(broken))
    patch.setattr(torch.cuda, "is_initialized", lambda: bool(broken))
    patch.setattr(torch.cuda, "synchronize", synchronize)
    return core


@contextlib.contextmanager
def serve(factory: str) -> Iterator[tuple[str, list[str]]]:
    config = EngineConfig(
        model="random:qwen3-tiny",
        served_model_name=MODEL,
        runner="v2",
        device="cpu",
        dtype="float32",
        num_gpu_blocks=64,
        block_size=8,
        max_num_seqs=8,
        max_model_len=128,
        async_scheduling=True,
    )
    reasons: list[str] = []
    app = create_app(config, core_factory=f"{__name__}:{factory}", on_fatal=reasons.append)
    with threaded_server(app, ready_timeout_s=300) as base_url:
        yield base_url, reasons


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


PROMPTS = [[300 + i, 20, 30 + i, 40, 50, 60 + i, 70] for i in range(3)]
POISONED = [5, POISON, POISON, POISON, 6, 7]


def complete(api: openai.OpenAI, prompt: list[int]) -> str:
    reply = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    return reply.choices[0].text


def test_a_poisoned_request_fails_alone_through_the_openai_client() -> None:
    with serve("faulty_core") as (base_url, _):
        api = client(base_url)
        alone = [complete(api, p) for p in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = [pool.submit(complete, api, p) for p in PROMPTS]
            failed = pool.submit(complete, api, POISONED)
            with pytest.raises(openai.InternalServerError) as raised:
                failed.result(timeout=300)
            assert [f.result(timeout=300) for f in together] == alone
        message = str(raised.value)
        assert "failed while running this request" in message and "FaultError" in message
        assert "Traceback" not in message and ".py" not in message
        with httpx.Client(base_url=base_url, timeout=30) as http:
            assert http.get("/health").status_code == 200
            stats = http.get("/v1/engine/info").json()["stats"]
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert complete(api, PROMPTS[0]) == alone[0]  # still serving


def test_a_device_that_runs_no_more_work_stops_the_server_with_its_error() -> None:
    with serve("broken_device_core") as (base_url, _):
        api = client(base_url)
        complete(api, PROMPTS[0])
        with pytest.raises(openai.APIStatusError):
            complete(api, POISONED)
        with httpx.Client(base_url=base_url, timeout=30) as http:
            deadline = time.monotonic() + 60
            health = http.get("/health")
            while health.status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
                health = http.get("/health")
            assert health.status_code == 503
            message = health.json()["error"]["message"]
            assert "DeviceFailure" in message and "illegal memory access" in message
            assert "restart" in message
            assert http.post("/v1/completions", json={"prompt": [1, 2]}).status_code == 503
