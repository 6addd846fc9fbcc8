"""Runner selection: the kind and the reason, and refusals that name the flag or feature."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.runner import select
from davit_engine.runner.sampler import register_logits_processor, unregister_logits_processor
from davit_engine.runner.select import resolve_device, select_runner
from davit_engine.types import ParamError

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.fixture
def custom_processor() -> Iterator[None]:
    register_logits_processor("test-identity", lambda _ids, row: row)
    yield
    unregister_logits_processor("test-identity")


def config(runner: str) -> EngineConfig:
    return EngineConfig(model="random:qwen3-tiny", runner=runner)  # type: ignore[arg-type]


def test_cpu_auto_and_v1_pick_v1() -> None:
    assert select_runner(config("auto"), CPU) == ("v1", "runner V2 needs a CUDA device")
    assert select_runner(config("v1"), CPU)[0] == "v1"


def test_explicit_v2_on_cpu_names_the_flag() -> None:
    with pytest.raises(ParamError, match="needs a CUDA device") as err:
        select_runner(config("v2"), CPU)
    assert err.value.param == "--runner"


def test_cuda_auto_prefers_v2_when_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(select, "_v2_available", lambda: True)
    assert select_runner(config("auto"), CUDA) == ("v2", "CUDA device available")
    monkeypatch.setattr(select, "_v2_available", lambda: False)
    kind, reason = select_runner(config("auto"), CUDA)
    assert kind == "v1" and "not included" in reason


@pytest.mark.usefixtures("custom_processor")
def test_custom_logits_processors_need_v1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(select, "_v2_available", lambda: True)
    kind, reason = select_runner(config("auto"), CUDA)
    assert kind == "v1" and "custom logits processors (test-identity)" in reason
    with pytest.raises(ParamError, match="custom logits processors") as err:
        select_runner(config("v2"), CUDA)
    assert err.value.param == "--runner"


def test_bad_device_flag() -> None:
    with pytest.raises(ParamError) as err:
        resolve_device(EngineConfig(model="random:qwen3-tiny", device="tpu"))
    assert err.value.param == "--device"
    if not torch.cuda.is_available():
        with pytest.raises(ParamError, match="no CUDA device"):
            resolve_device(EngineConfig(model="random:qwen3-tiny", device="cuda"))


def test_speculative_decoding_needs_runner_v2() -> None:
    from davit_engine.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=3)
    for runner, device in (("v1", "cuda"), ("auto", "cpu")):
        config = EngineConfig(model="random:qwen3-tiny", runner=runner, speculative_config=spec)  # type: ignore[arg-type]
        with pytest.raises(ParamError) as err:
            select_runner(config, torch.device(device))
        assert err.value.param == "--speculative-config" and "runner V2" in err.value.message
