"""config.json over HTTP (loopback server): shapes for models the catalog lacks, never required."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from davit_operator.catalog.loader import load_catalog
from davit_operator.model_config import ModelConfigSource
from davit_operator.planning.errors import PlanError
from davit_operator.planning.memory import ShapeError, load_shape_catalog, shape_from_config
from davit_operator.planning.plan import make_plan
from tests.operator.isvc_helpers import make_spec

# A 34B-class config (not in the catalog): about 68 GB of bf16 weights.
BIG = {
    "num_hidden_layers": 60,
    "hidden_size": 7168,
    "intermediate_size": 20480,
    "num_attention_heads": 56,
    "num_key_value_heads": 8,
    "vocab_size": 64000,
    "max_position_embeddings": 32768,
}


class _Hub(BaseHTTPRequestHandler):
    files: dict[str, Any] = {"/org/big/resolve/main/config.json": BIG}
    requests: list[str] = []

    def do_GET(self) -> None:
        type(self).requests.append(self.path)
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[str]:
    _Hub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_fetched_shape_feeds_the_preflight_check(hub: str) -> None:
    source = ModelConfigSource(hub)
    spec = make_spec(
        model={"source": "hf://org/big", "revision": "main"},
        accelerator={"vendor": "nvidia", "product": "NVIDIA-H100-80GB-HBM3"},
    )
    shapes = asyncio.run(source.shapes_for(spec, load_shape_catalog()))
    shape = shapes.find("org/big")
    assert shape is not None and shape.head_dim == 128 and shape.num_kv_heads == 8
    with pytest.raises(PlanError) as err:
        make_plan("s", "ns", spec, load_catalog(), shapes=shapes)
    assert err.value.reason == "InsufficientMemory"
    # Without the fetched shape the check is skipped, not failed.
    assert make_plan("s", "ns", spec, load_catalog()).memory is None
    # Remembered: a second reconcile does not fetch again. (Without a quantization_config in
    # config.json, hf_quant_config.json is asked for once too: a 404 here.)
    asyncio.run(source.shapes_for(spec, load_shape_catalog()))
    assert _Hub.requests == [
        "/org/big/resolve/main/config.json",
        "/org/big/resolve/main/hf_quant_config.json",
    ]


def test_unreachable_or_missing_configs_leave_the_shape_unknown(hub: str) -> None:
    catalog = load_shape_catalog()
    missing = make_spec(model={"source": "hf://org/missing", "revision": "v1"})
    assert asyncio.run(ModelConfigSource(hub).shapes_for(missing, catalog)) == catalog
    closed = ModelConfigSource("http://127.0.0.1:9", timeout=1.0)
    assert asyncio.run(closed.shapes_for(missing, catalog)) == catalog
    # Known shapes and non-hf sources never cause a request.
    known = make_spec(model={"source": "hf://Qwen/Qwen3-8B", "revision": "main"})
    asyncio.run(ModelConfigSource(hub).shapes_for(known, catalog))
    assert _Hub.requests == ["/org/missing/resolve/v1/config.json"]


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ([], "not a JSON object"),
        ({k: v for k, v in BIG.items() if k != "vocab_size"}, "no vocab_size"),
        ({**BIG, "hidden_size": "wide"}, "config.json"),
        ({**BIG, "num_hidden_layers": 0}, "config.json"),
    ],
)
def test_bad_configs_are_refused_by_name(config: Any, error: str) -> None:
    with pytest.raises(ShapeError, match=error):
        shape_from_config(config)


def test_multimodal_text_config_is_read() -> None:
    shape = shape_from_config({"text_config": BIG, "architectures": ["X"]})
    assert shape.num_layers == 60


FP8_CONFIGS = [
    {"quant_method": "fp8", "activation_scheme": "dynamic"},
    {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    {"quant_method": "compressed-tensors",
     "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}},
    {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    # ModelOpt exports: settings at the top (config.json) or under `quantization`
    {"quant_method": "modelopt", "quant_algo": "fp8", "ignore": ["lm_head"]},
    {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"},
    {"producer": {"name": "modelopt", "version": "0.29.0"},
     "quantization": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "exclude_modules": ["lm_head"]}},
]  # fmt: skip


@pytest.mark.parametrize("quant", FP8_CONFIGS)
def test_an_fp8_checkpoint_is_estimated_at_one_byte_per_projection_weight(
    hub: str, quant: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 34B-class shape above does not fit an 80 GB H100 in bf16; its FP8 checkpoint (about
    34 GB of projections) does, without engine.quantization: the estimate reads the checkpoint's
    quantization_config, and equals the one for engine.quantization fp8."""
    fp8_config = {**BIG, "quantization_config": quant}
    monkeypatch.setattr(
        _Hub, "files", {**_Hub.files, "/org/big-fp8/resolve/main/config.json": fp8_config}
    )
    spec = make_spec(
        model={"source": "hf://org/big-fp8", "revision": "main"},
        accelerator={"vendor": "nvidia", "product": "NVIDIA-H100-80GB-HBM3"},
    )
    shapes = asyncio.run(ModelConfigSource(hub).shapes_for(spec, load_shape_catalog()))
    shape = shapes.find("org/big-fp8")
    assert shape is not None and shape.fp8_projections
    memory = make_plan("s", "ns", spec, load_catalog(), shapes=shapes).memory  # no PlanError
    assert memory is not None and memory.weights_bytes is not None
    assert 30e9 < memory.weights_bytes < 40e9
    flagged = make_spec(
        model={"source": "hf://org/big-fp8", "revision": "main"},
        accelerator={"vendor": "nvidia", "product": "NVIDIA-H100-80GB-HBM3"},
        engine={"type": "davit", "version": "0.1.0", "quantization": "fp8"},
    )
    with_flag = make_plan("s", "ns", flagged, load_catalog(), shapes=shapes).memory
    assert with_flag is not None
    assert (with_flag.weights_bytes, with_flag.kv_cache_bytes) == (
        memory.weights_bytes,
        memory.kv_cache_bytes,
    )


@pytest.mark.parametrize(
    "quant",
    [None, {"quant_method": "gptq", "bits": 4}, "fp8",
     {"quant_method": "compressed-tensors",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8}}}},
     {"quant_method": "modelopt_fp4", "quant_algo": "NVFP4"},
     {"quant_method": "modelopt", "quant_algo": "MXFP8"},
     {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "W4A16_NVFP4"}}],
)  # fmt: skip
def test_other_checkpoints_count_at_the_accelerator_dtype(quant: Any) -> None:
    assert not shape_from_config({**BIG, "quantization_config": quant}).fp8_projections


def test_a_modelopt_export_with_hf_quant_config_is_estimated_in_fp8(
    hub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ModelOpt export whose settings are in hf_quant_config.json (config.json has no
    quantization_config) counts at one byte per projection weight, as the engine loads it; a
    repository without that file is read from config.json alone (its 404 is no error)."""
    legacy = {"producer": {"name": "modelopt", "version": "0.29.0"},
              "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}  # fmt: skip
    monkeypatch.setattr(_Hub, "files", {
        **_Hub.files,
        "/org/mo/resolve/main/config.json": BIG,
        "/org/mo/resolve/main/hf_quant_config.json": legacy,
    })  # fmt: skip
    shapes = asyncio.run(ModelConfigSource(hub).shapes_for(
        make_spec(model={"source": "hf://org/mo", "revision": "main"}), load_shape_catalog()))  # fmt: skip
    shape = shapes.find("org/mo")
    assert shape is not None and shape.fp8_projections
    plain = asyncio.run(ModelConfigSource(hub).shapes_for(
        make_spec(model={"source": "hf://org/big", "revision": "main"}), load_shape_catalog()))  # fmt: skip
    found = plain.find("org/big")
    assert found is not None and not found.fp8_projections
    assert "/org/big/resolve/main/hf_quant_config.json" in _Hub.requests


def test_block_scales_served_natively_count_one_scale_per_row_and_group(
    hub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 128 x 128 block checkpoint served with its own scales (engine.extraArgs
    `--fp8-block-scales native`) holds one float32 scale per output row and 128 input columns
    instead of one per row: the estimate grows by exactly that, with the flag in either
    spelling."""
    block = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    monkeypatch.setattr(
        _Hub, "files", {**_Hub.files, "/org/big-blk/resolve/main/config.json": {
            **BIG, "quantization_config": block}},
    )  # fmt: skip
    source = {"source": "hf://org/big-blk", "revision": "main"}
    h100 = {"vendor": "nvidia", "product": "NVIDIA-H100-80GB-HBM3"}
    base = make_spec(model=source, accelerator=h100)
    shapes = asyncio.run(ModelConfigSource(hub).shapes_for(base, load_shape_catalog()))
    shape = shapes.find("org/big-blk")
    assert shape is not None and shape.fp8_block_columns == 128
    assert shape_from_config({**BIG, "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
            "type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 64]}}}},
    }).fp8_block_columns == 64  # fmt: skip

    def weights(extra: list[str]) -> int:
        spec = make_spec(model=source, accelerator=h100,
                         engine={"type": "davit", "version": "0.1.0", "extraArgs": extra})  # fmt: skip
        memory = make_plan("s", "ns", spec, load_catalog(), shapes=shapes).memory
        assert memory is not None and memory.weights_bytes is not None
        return memory.weights_bytes

    channel = weights([])
    h, d, i, layers = 7168, 128, 20480, 60
    groups = layers * (((56 + 16) * d + 2 * i) * 56 + h * 56 + h * 160)
    channels = layers * ((56 + 16) * d + h + 2 * i + h)
    assert shape.projection_scale_groups(128) == groups
    for extra in (["--fp8-block-scales", "native"], ["--fp8-block-scales=native"]):
        assert weights(extra) - channel == 4 * (groups - channels)
    assert weights(["--fp8-block-scales", "channel"]) == channel
    assert 0.02 < 4 * (groups - channels) / channel < 0.04  # about 3% of the FP8 weights
