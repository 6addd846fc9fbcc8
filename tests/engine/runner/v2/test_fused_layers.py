from __future__ import annotations

import pytest
import torch

from davit_engine.config import EngineConfig
from davit_engine.kernels.attention_backend import TritonPagedAttention
from davit_engine.layers.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from davit_engine.loader import load_model
from davit_engine.models.config import ModelConfig
from davit_engine.runner.v2 import fused_layers
from davit_engine.runner.v2.fused_layers import install_fused_layers


def _prefill_meta(
    device: torch.device, num_tokens: int, num_blocks: int, backend: AttentionBackend
) -> AttentionMetadata:
    positions = torch.arange(num_tokens, device=device)
    return AttentionMetadata(
        slot_mapping=positions,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        backend=backend,
    )


@pytest.mark.parametrize("model", ["random:qwen3-tiny", "random:qwen2-tiny", "random:llama-tiny"])
@pytest.mark.parametrize("fused_backend", ["torch", "triton"])
def test_fused_layers_keep_the_model_output(
    device: torch.device, model: str, fused_backend: str
) -> None:
    """A prefill through the model with the fused kernels swapped in matches the plain model
    (fp32 tiny models: RMSNorm, residual add + norm, q/k norm, rotary, SiLU all fused). With the
    Triton backend the rotary kernel also writes the KV cache: the caches must match too."""
    config = EngineConfig(model=model, dtype="float32", device=device.type)
    plain = load_model(config, device).model
    fused = load_model(config, device).model
    fused.load_state_dict(plain.state_dict())
    num_swapped = install_fused_layers(fused)
    kinds = ("RMSNorm", "LlamaAttention", "LlamaMLP", "LlamaForCausalLM")
    assert num_swapped == len([m for m in fused.modules() if type(m).__name__ in kinds])
    num_tokens, page, num_blocks = 11, 4, 4
    ids = torch.randint(0, 512, (num_tokens,), device=device)
    outs, caches_out = [], []
    backends: list[AttentionBackend] = [
        TorchPagedAttention(),
        TorchPagedAttention() if fused_backend == "torch" else TritonPagedAttention(),
    ]
    for net, backend in zip((plain, fused), backends, strict=True):
        c = net.config
        caches = [
            torch.zeros(2, num_blocks, page, c.num_kv_heads, c.head_dim, device=device)
            for _ in range(c.num_layers)
        ]
        meta = _prefill_meta(device, num_tokens, num_blocks, backend)
        with torch.inference_mode():
            outs.append(
                net.compute_logits(net(ids, torch.arange(num_tokens, device=device), caches, meta))
            )
        caches_out.append(torch.stack(caches))
    assert torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    assert torch.allclose(caches_out[0], caches_out[1], atol=1e-5, rtol=1e-5)


def test_unknown_model_composition_is_left_alone(device: torch.device) -> None:
    """A subclass of the model (another composition) keeps its own forward."""
    config = EngineConfig(model="random:qwen3-tiny", dtype="float32", device=device.type)
    model = load_model(config, device).model

    class Wrapped(type(model)):  # type: ignore[misc]
        pass

    model.__class__ = Wrapped
    install_fused_layers(model)
    assert "forward" not in vars(model)  # the model forward was not swapped
    assert all("forward" in vars(m) for m in model.modules() if type(m).__name__ == "RMSNorm")


def _fp8_prefill(
    net: torch.nn.Module, device: torch.device, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a prefill of `ids` through `net` with FP8 caches and the Triton backend, and
    the caches' bytes (per-head scales that saturate a few values)."""
    c = net.config
    for module in net.modules():
        if hasattr(module, "kv_scale"):
            module.kv_scale.copy_(torch.linspace(0.002, 0.01, 2 * c.num_kv_heads).view(2, -1))
    num_tokens, page, num_blocks = ids.shape[0], 4, 4
    caches = [
        torch.zeros(2, num_blocks, page, c.num_kv_heads, c.head_dim, device=device).to(
            torch.float8_e4m3fn
        )
        for _ in range(c.num_layers)
    ]
    meta = _prefill_meta(device, num_tokens, num_blocks, TritonPagedAttention())
    with torch.inference_mode():
        logits = net.compute_logits(net(ids, torch.arange(num_tokens, device=device), caches, meta))
    return logits.float(), torch.stack(caches).view(torch.uint8)


@pytest.mark.parametrize(
    ("model", "dtype"),
    [
        ("random:qwen3-tiny", torch.float32),
        ("random:llama-tiny", torch.float32),
        ("random:qwen2-tiny", torch.bfloat16),
        ("random:qwen3-tiny", torch.bfloat16),
    ],
)
def test_fused_layers_with_an_fp8_cache_rotate_queries_before_attention(
    device: torch.device, model: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With an FP8 cache and the Triton backend the rotary kernel quantizes keys and values into
    the cache and hands attention its queries rotated (`q @ H`), so the attention kernel does
    not rotate them. Against the same fused model with attention rotating them: the same
    cache bytes and the same logits; in float32 against the plain model, whose cache
    `write_kv` writes: the same logits and bytes up to a rare rounding flip. (In bf16 the
    plain model rounds differently in the other fused layers.)"""
    torch.manual_seed(11)
    config = EngineConfig(model=model, dtype=str(dtype).removeprefix("torch."), device=device.type)
    plain = load_model(config, device).model
    fused = load_model(config, device).model
    fused.load_state_dict(plain.state_dict())
    install_fused_layers(fused)
    ids = torch.randint(0, 512, (11,), device=device)
    logits, cache = _fp8_prefill(fused, device, ids)
    assert float((cache != 0).float().mean()) > 0.5  # the tokens' slots were written
    calls: list[bool] = []
    real_forward = TritonPagedAttention.forward

    def forward(self: TritonPagedAttention, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(bool(kwargs.get("queries_rotated")))
        return real_forward(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(TritonPagedAttention, "forward", forward)
    _fp8_prefill(fused, device, ids)
    assert calls and all(calls)  # every layer's attention took rotated queries
    monkeypatch.setattr(fused_layers, "rotates_keys", lambda head_dim: False)
    calls.clear()
    logits_unrotated, cache_unrotated = _fp8_prefill(fused, device, ids)
    assert calls and not any(calls)
    assert torch.equal(cache, cache_unrotated)
    scale = float(logits.abs().max())
    assert float((logits - logits_unrotated).abs().max()) <= 1e-5 * scale
    if dtype == torch.float32:
        logits_plain, cache_plain = _fp8_prefill(plain, device, ids)
        # The plain model's norms and products sum in another order, so a value lying at an
        # e4m3 rounding midpoint may round the other way (one byte of 4,096 on one CPU, none
        # on another): at most a few bytes, each one e4m3 step from the fused model's.
        differ = cache != cache_plain
        assert int(differ.sum()) <= 4
        assert bool(((cache.int() - cache_plain.int())[differ].abs() == 1).all())
        assert float((logits - logits_plain).abs().max()) <= 1e-4 * scale


def _caches(
    c: ModelConfig, num_blocks: int, page: int, device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    shape = (2, num_blocks, page, c.num_kv_heads, c.head_dim)
    return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.num_layers)]


@pytest.mark.parametrize("fuse_activation", [True, False])
def test_fused_layers_with_fp8_projections(
    device: torch.device, fuse_activation: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FP8 projections at two tokens (decode rows: on a GPU the gate/up projection's kernel
    applies SiLU x up itself, `FUSE_FP8_GATE_ACTIVATION`; off, the separate kernel): the fused
    model gives the plain model's logits."""
    monkeypatch.setattr(fused_layers, "FUSE_FP8_GATE_ACTIVATION", fuse_activation)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    config = EngineConfig(model="random:qwen3-tiny", dtype=dtype, device=device.type,
                          quantization="fp8")  # fmt: skip
    plain = load_model(config, device).model
    fused = load_model(config, device).model
    fused.load_state_dict(plain.state_dict())
    assert type(fused.model.layers[0].mlp.gate_up_proj).__name__ == "Fp8Linear"
    install_fused_layers(fused)
    num_tokens, page, num_blocks = 2, 4, 1
    ids = torch.tensor([5, 77], device=device)
    outs = []
    for net, backend in ((plain, TorchPagedAttention()), (fused, TritonPagedAttention())):
        caches = _caches(net.config, num_blocks, page, device, getattr(torch, dtype))
        meta = _prefill_meta(device, num_tokens, num_blocks, backend)
        with torch.inference_mode():
            hidden = net(ids, torch.arange(num_tokens, device=device), caches, meta)
            outs.append(net.compute_logits(hidden).float())
    tol = 3e-2 if dtype == "bfloat16" else 1e-4
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("model", ["random:qwen3-tiny", "random:qwen2-tiny", "random:llama-tiny"])
def test_norms_folded_into_one_row_products(
    device: torch.device, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`NORM_IN_ONE_ROW_PRODUCTS`: a one-token decode step after a five-token prefill (the
    prefill takes the unfused kernels, the step the products with the norms folded in, every
    layer's adds but the last) gives the plain model's logits and KV caches; q/k/v with a bias
    (qwen2) and per-head norms (qwen3) included."""
    _norm_chain_case(device, model, monkeypatch, quantization="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["random:qwen3-tiny", "random:qwen2-tiny"])
def test_norms_folded_into_one_row_products_on_the_gpu(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _norm_chain_case(torch.device("cuda"), model, monkeypatch, quantization="fp8")


@pytest.fixture(scope="module")
def block_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The random qwen3-tiny written as a block-wise FP8 checkpoint (32 x 32 blocks)."""
    from safetensors.torch import load_file

    from davit_engine.loader.random_weights import save_hf_directory
    from davit_tools.bench.fp8_quality import write_block_fp8_checkpoint

    source = tmp_path_factory.mktemp("qwen3-tiny")
    loaded = load_model(EngineConfig(model="random:qwen3-tiny", dtype="float32", seed=7),
                        torch.device("cpu"))  # fmt: skip
    save_hf_directory(loaded.model, source)
    target = tmp_path_factory.mktemp("qwen3-tiny-blocks") / "blk"
    weights = list(load_file(str(source / "model.safetensors")).items())
    write_block_fp8_checkpoint(loaded.config, weights, target, (32, 32))
    return str(target)


def test_norms_folded_into_native_block_products(
    device: torch.device, block_checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The norm chain over a block-wise checkpoint served with its own scales
    (`--fp8-block-scales native`): the block kernels' folded forms give the plain model's
    logits and KV caches."""
    _norm_chain_case(device, block_checkpoint, monkeypatch, "fp8_block",
                     fp8_block_scales="native")  # fmt: skip


@pytest.mark.gpu
def test_norms_folded_into_native_block_products_on_the_gpu(
    block_checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _norm_chain_case(torch.device("cuda"), block_checkpoint, monkeypatch, "fp8_block",
                     fp8_block_scales="native")  # fmt: skip


def _prefill_then_step(
    net: torch.nn.Module, device: torch.device, dtype: str, backend: AttentionBackend
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a one-token step after a five-token prefill, and the caches after it (as
    float32)."""
    page, num_blocks = 4, 2
    caches = _caches(net.config, num_blocks, page, device, getattr(torch, dtype))
    with torch.inference_mode():
        net(torch.tensor([5, 77, 301, 9, 140], device=device), torch.arange(5, device=device),
            caches, _prefill_meta(device, 5, num_blocks, backend))  # fmt: skip
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([5], device=device),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([6], dtype=torch.int32, device=device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
            max_query_len=1,
            max_seq_len=6,
            backend=backend,
        )
        hidden = net(torch.tensor([42], device=device), torch.tensor([5], device=device),
                     caches, meta)  # fmt: skip
        logits = net.compute_logits(hidden).float()
    return logits, torch.stack([c.float() for c in caches])


def _norm_chain_case(
    device: torch.device,
    model: str,
    monkeypatch: pytest.MonkeyPatch,
    kernels: str = "fp8_gemv",  # the module whose one-row kernels the chain must take
    **config_args: object,
) -> None:
    from davit_engine.kernels import fp8_block, fp8_gemv

    monkeypatch.setattr(fused_layers, "NORM_IN_ONE_ROW_PRODUCTS", True)
    calls = {"add_norm": 0, "normed": 0}
    module = {"fp8_gemv": fp8_gemv, "fp8_block": fp8_block}[kernels]
    prefix = "fp8_gemv" if kernels == "fp8_gemv" else "block_gemv"
    for key in ("add_norm", "normed"):
        original = getattr(module, f"{prefix}_{key}")

        def counted(*args: object, _f: object = original, _k: str = key, **kw: object) -> object:
            calls[_k] += 1
            return _f(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(module, f"{prefix}_{key}", counted)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    config = EngineConfig(model=model, dtype=dtype, device=device.type, **config_args)  # type: ignore[arg-type]
    plain = load_model(config, device).model
    fused = load_model(config, device).model
    fused.load_state_dict(plain.state_dict())
    install_fused_layers(fused)
    outs, caches_out = [], []
    for net, backend in ((plain, TorchPagedAttention()), (fused, TritonPagedAttention())):
        logits, caches = _prefill_then_step(net, device, dtype, backend)
        outs.append(logits)
        caches_out.append(caches)
    layers = len(fused.model.layers)
    # o and down of every layer but the last one's down; gate/up of every layer, q/k/v but the
    # first layer's
    assert calls == {"add_norm": 2 * layers - 1, "normed": 2 * layers - 1}
    tol = 3e-2 if dtype == "bfloat16" else 1e-4
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
    torch.testing.assert_close(caches_out[1], caches_out[0], atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_norm_chain_through_the_engine(
    enforce_eager: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folded norms (`NORM_IN_ONE_ROW_PRODUCTS`) through runner V2 at one request (decode
    steps of one token, inside the captured CUDA graph unless eager): the greedy tokens of the
    unfused kernels (float32 activations, so the moved rounding is below the logits' ties)."""
    from davit_engine.kernels import fp8_gemv
    from davit_engine.llm import LLM
    from davit_engine.types import SamplingParams

    calls = {"n": 0}
    original = fp8_gemv.fp8_gemv_add_norm

    def counted(*args: object, **kw: object) -> object:
        calls["n"] += 1
        return original(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(fp8_gemv, "fp8_gemv_add_norm", counted)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for on in (False, True):
        monkeypatch.setattr(fused_layers, "NORM_IN_ONE_ROW_PRODUCTS", on)
        calls["n"] = 0
        llm = LLM("random:llama-tiny", device="cuda", dtype="float32", quantization="fp8",
                  runner="v2", enforce_eager=enforce_eager, max_num_batched_tokens=256)  # fmt: skip
        try:
            tokens[on] = [out.token_ids for out in llm.generate([[5, 9, 77, 300, 12]], greedy)]
        finally:
            llm.shutdown()
        assert (calls["n"] > 0) == on
    assert tokens[True] == tokens[False]
