"""The profiler on the CPU: the same code path as on a GPU, measured on the resident set."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from davit_contract.profile import MemoryProfile
from davit_engine.config import EngineConfig
from davit_engine.engine_core import EngineCore
from davit_engine.memory.profiler import CPU_KV_CAP_BYTES
from davit_engine.server import profile_only
from davit_engine.types import ParamError

TINY = "random:qwen3-tiny"


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=TINY, dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=1024
        )
    )


def test_profile_measures_each_component(core: EngineCore) -> None:
    profile = core.memory_profile
    assert profile is not None
    m, ident = profile.memory, profile.identity
    assert m.method in ("cpu-rss", "cpu-rss-unreset") and m.kv_source == "profile"
    # qwen3-tiny in float32: parameter bytes exactly.
    params = sum(p.numel() * 4 for p in core.runner.model.parameters())  # type: ignore[attr-defined]
    assert m.weights_bytes >= params
    # The activation peak is the resident set's growth: in this long-lived test process the
    # allocator may serve the forward from pages earlier tests left resident, so it is checked
    # in a fresh process (test_profile_only_prints_writes_and_serves_nothing).
    assert m.non_torch_bytes > 0
    assert m.total_bytes > m.budget_bytes > 0
    # The CPU cap: no more than max_num_seqs full-length sequences (or 2 GiB).
    blocks_per_seq = -(-ident.max_model_len // ident.block_size)
    wanted = ident.max_num_seqs * blocks_per_seq * m.block_bytes
    assert m.kv_cache_bytes == min(wanted, CPU_KV_CAP_BYTES, m.kv_cache_bytes)
    assert m.num_blocks == core.model_info.num_blocks
    assert m.max_concurrency == m.token_capacity / ident.max_model_len
    assert ident.device == "cpu" and ident.runner == "v1" and ident.dtype == "float32"
    assert ident.max_num_seqs == 8 and ident.max_num_batched_tokens == 1024
    # The front end gets it with the model info.
    assert core.model_info.memory_profile == profile.to_dict()


def test_explicit_kv_bytes_skip_the_search_but_are_checked() -> None:
    config = EngineConfig(
        model=TINY, dtype="float32", device="cpu", max_num_seqs=4, kv_cache_memory_bytes=1 << 20
    )
    core = EngineCore(config)
    profile = core.memory_profile
    assert profile is not None and profile.memory.kv_source == "explicit"
    assert profile.memory.kv_cache_bytes == 1 << 20
    assert core.model_info.num_blocks == (1 << 20) // profile.memory.block_bytes
    too_big = EngineConfig(model=TINY, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 50)
    with pytest.raises(ParamError) as err:
        EngineCore(too_big)
    assert err.value.param == "--kv-cache-memory-bytes"
    assert "do not fit" in err.value.message and "weights" in err.value.message


def test_no_room_names_the_utilization_flag() -> None:
    with pytest.raises(ParamError) as err:
        EngineCore(
            EngineConfig(model=TINY, dtype="float32", device="cpu", gpu_memory_utilization=1e-6)
        )
    assert err.value.param == "--gpu-memory-utilization"
    assert "no memory left for the KV cache" in err.value.message


def test_profile_only_prints_writes_and_serves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "davit_cli",
            "serve",
            TINY,
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--port",
            str(port),
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "1024",
            "--profile-only",
            "--profile-output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    printed = MemoryProfile.from_json(result.stdout.strip().splitlines()[-1])
    assert MemoryProfile.from_json(out.read_text()) == printed
    assert printed.identity.model == TINY and printed.identity.max_num_seqs == 4
    # A fresh engine process: the forward's attention scores ([4, 1024, 1024] fp32) are new
    # pages, so the resident-set peak above the loaded weights is seen.
    assert printed.memory.activation_peak_bytes > 0 and printed.memory.non_torch_bytes > 0
    assert "Uvicorn running" not in result.stderr


def test_profile_only_failure_exits_1(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "davit_cli",
            "serve",
            TINY,
            "--gpu-memory-utilization",
            "0.000001",
            "--profile-only",
            "--profile-output",
            str(tmp_path / "p.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "--gpu-memory-utilization" in result.stderr
    assert not (tmp_path / "p.json").exists()


def test_default_output_is_the_termination_log_when_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setattr(profile_only, "TERMINATION_LOG", log)
    assert profile_only.default_output() is None
    log.write_text("")
    assert profile_only.default_output() == log
