"""Engine test fixtures: CPU threads, the SmolLM2 reference model and tiny random checkpoints;
the device for kernel tests (the GPU when there is one, else the CPU under Triton's interpreter,
which must be chosen before any kernel module is imported, hence here) and the `gpu` marker.

Heavy objects (the GGUF engine, the transformers reference model) are session-scoped so the
whole engine suite loads each once.
"""

from __future__ import annotations

import os

# The machine's cores are shared: OpenMP's default spin-waiting then slows multi-threaded torch
# ops by tens of times. Only effective when torch is not loaded yet (true for `pytest tests`).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support import reference_gguf

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _cpu_threads() -> None:
    # Two cores shared with other work: more threads only add contention.
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the reference GGUF."""
    return reference_gguf()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path) -> tuple[Any, Any]:
    """(transformers model in fp32, transformers tokenizer) from the same GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    return model, tokenizer


def _hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Any, list[int], int], list[int]]:
    """transformers greedy generate(model, prompt_ids, max_new_tokens) for one unpadded prompt.

    Returns the new token ids (EOS included when generation stopped on it).
    """
    return _hf_greedy


@pytest.fixture(scope="session")
def qwen3_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The random `qwen3-tiny` shape saved as a Hugging Face directory (config + safetensors)."""
    from davit_engine.config import EngineConfig
    from davit_engine.loader import load_model
    from davit_engine.loader.random_weights import save_hf_directory

    directory = tmp_path_factory.mktemp("qwen3-tiny")
    loaded = load_model(
        EngineConfig(model="random:qwen3-tiny", dtype="float32", seed=7), torch.device("cpu")
    )
    save_hf_directory(loaded.model, directory)
    yield directory
