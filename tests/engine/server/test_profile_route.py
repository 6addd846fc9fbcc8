"""`GET /v1/engine/profile` on a real `davit serve` process (tiny random model, CPU)."""

from __future__ import annotations

from pathlib import Path

import httpx

from davit_contract.profile import MemoryProfile

from .harness import ServeProcess


def test_the_server_serves_its_startup_profile(tmp_path: Path) -> None:
    args = ["random:qwen3-tiny", "--dtype", "float32", "--max-num-seqs", "4"]
    args += ["--max-num-batched-tokens", "128"]
    proc = ServeProcess(args, tmp_path / "serve.log")
    try:
        proc.wait_ready()
        response = httpx.get(f"{proc.base_url}/v1/engine/profile", timeout=30)
        assert response.status_code == 200, response.text
        profile = MemoryProfile.from_dict(response.json())
        assert profile.identity.model == "random:qwen3-tiny"
        assert profile.identity.max_num_batched_tokens == 128
        assert profile.memory.kv_source == "profile" and profile.memory.num_blocks > 0
        info = httpx.get(f"{proc.base_url}/v1/engine/info", timeout=30).json()
        assert info["model_info"]["num_blocks"] == profile.memory.num_blocks
        assert "memory profile: " in proc.log()
    finally:
        assert proc.terminate() == 0, proc.log()


def test_an_override_start_has_no_profile_to_serve(tmp_path: Path) -> None:
    args = ["random:qwen3-tiny", "--dtype", "float32", "--num-gpu-blocks-override", "64"]
    proc = ServeProcess(args, tmp_path / "serve.log")
    try:
        proc.wait_ready()
        response = httpx.get(f"{proc.base_url}/v1/engine/profile", timeout=30)
        assert response.status_code == 200
        profile = MemoryProfile.from_dict(response.json())
        assert profile.memory.kv_source == "override" and profile.memory.method == "none"
        assert profile.memory.num_blocks == 64
    finally:
        assert proc.terminate() == 0, proc.log()
