"""The engine's flag defaults come from the contract, so the operator plans with the same ones."""

from __future__ import annotations

from davit_contract import engine_defaults
from davit_engine.config import EngineConfig
from davit_engine.server.cli import build_parser


def test_parser_and_config_use_the_contract_defaults() -> None:
    args = build_parser().parse_args(["some-model"])
    config = EngineConfig(model="some-model")
    for flag, value in (
        ("block_size", engine_defaults.BLOCK_SIZE),
        ("max_num_seqs", engine_defaults.MAX_NUM_SEQS),
        ("max_num_batched_tokens", engine_defaults.MAX_NUM_BATCHED_TOKENS),
        ("gpu_memory_utilization", engine_defaults.GPU_MEMORY_UTILIZATION),
    ):
        assert getattr(args, flag) == value, flag
        assert getattr(config, flag) == value, flag
