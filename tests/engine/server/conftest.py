"""Fixtures for the HTTP front end: the app served on loopback with the fake engine core."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from davit_engine.config import EngineConfig
from davit_engine.server.app import create_app
from davit_engine.server.state import ServerSettings, ServerState
from davit_engine.tokenizer import ByteTokenizer, Tokenizer

from . import fake_core
from .harness import threaded_server

FAKE_CORE = f"{fake_core.__name__}:FakeEngineCore"

# The core process is spawned and imports the fake core by module name, with the parent's
# sys.path; pytest's importlib import mode does not put the folder that name starts from there.
_IMPORT_ROOT = str(Path(fake_core.__file__).parents[len(fake_core.__name__.split(".")) - 1])
if _IMPORT_ROOT not in sys.path:
    sys.path.append(_IMPORT_ROOT)
MODEL = "fake-model"


def byte_tokenizer(_: EngineConfig) -> Tokenizer:
    return ByteTokenizer(fake_core.VOCAB_SIZE, None, (fake_core.EOS_TOKEN_ID,))


@dataclass
class FakeServer:
    base_url: str
    state: ServerState

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30.0)

    def stats(self) -> dict[str, Any]:
        response = httpx.get(f"{self.base_url}/v1/engine/info", timeout=10.0)
        response.raise_for_status()
        stats: dict[str, Any] = response.json()["stats"]
        return stats


@contextlib.contextmanager
def serve_fake(
    step_s: float = 0.01, settings: ServerSettings | None = None, **config: Any
) -> Iterator[FakeServer]:
    """The real app and core process, with the fake core stepping every `step_s` seconds."""
    previous = os.environ.get("DAVIT_FAKE_STEP_S")
    os.environ["DAVIT_FAKE_STEP_S"] = str(step_s)  # read by the spawned core process
    try:
        engine_config = EngineConfig(model=MODEL, **config)
        app = create_app(
            engine_config, settings, core_factory=FAKE_CORE, tokenizer_loader=byte_tokenizer
        )
        with threaded_server(app) as base_url:
            yield FakeServer(base_url, app.state.davit)
    finally:
        if previous is None:
            os.environ.pop("DAVIT_FAKE_STEP_S", None)
        else:
            os.environ["DAVIT_FAKE_STEP_S"] = previous


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    with serve_fake(step_s=0.005, max_num_seqs=8) as server:
        yield server
