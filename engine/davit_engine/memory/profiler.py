"""Measure a runner's memory before the KV cache exists and size the KV cache from it.

Called from the runners' `determine_num_blocks()`, after the weights are loaded:

1. weights: what torch's allocator holds right after loading (CUDA), or the parameter bytes
   (CPU); a speculative draft model is loaded with the target, so both count;
2. activation peak, the larger of two measurements:
   - one dummy forward over `max_num_batched_tokens` tokens, then the sampler over
     `max_num_seqs` rows with top-k and top-p active (the whole-row search path), inside one
     peak window. The dummy forward's own small KV cache stays in the figure: the sampler that
     follows reuses its freed blocks, so subtracting it would under-count;
   - (runner V2) real runner steps against a probe KV cache (`runner/v2/step_probe.py`): a full prefill
     chunk, a mixed step of `max_num_batched_tokens` tokens with `max_num_seqs` sampled rows,
     and a decode of every row, so the allocator keeps blocks of every size a real run
     caches side by side;
3. CUDA graphs (runner V2 on CUDA): the runner's persistent buffers (the graphs' shared logits
   buffer included) are allocated for a probe KV cache of one full-length sequence and the
   real decode graphs are captured into a private pool exactly as `initialize_kv_cache` will
   capture them; the pool's size is what stays reserved after the capture. The probe is then
   released and the run captures again with the same shapes, so the same pool size;
4. memory outside torch's allocator (CUDA context, cuBLAS/Triton workspaces, other processes on
   the device): device used - torch reserved, after the probes.

On the CPU the same steps run on the resident set size (`/proc/self/status`), with the peak
reset through `/proc/self/clear_refs` where the kernel allows it, and the KV cache capped at
`CPU_KV_CAP_BYTES` and at what `max_num_seqs` full-length sequences need.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import davit_engine
from davit_contract.profile import (
    KvSource,
    MemoryBreakdown,
    MemoryProfile,
    ProfileIdentity,
)
from davit_engine.types import ParamError

logger = logging.getLogger(__name__)

# KV budget on the CPU: a default start never takes the machine's memory.
CPU_KV_CAP_BYTES = 2 << 30
IMAGE_DIGEST_ENV = "DAVIT_IMAGE_DIGEST"
MODEL_REVISION_ENV = "DAVIT_MODEL_REVISION"


def size_kv_cache(
    runner: Any,
    dummy_forward: Callable[[int], None],
    probe_sampler: Callable[[], None],
    probe_graphs: Callable[[], tuple[int, int, tuple[int, ...]]] | None = None,
    probe_steps: Callable[[], int] | None = None,
) -> MemoryProfile:
    """Profile `runner` (a RunnerV1 or RunnerV2 with weights loaded, no KV cache yet).

    The runner brings its own probes, so this module never imports a runner:
    `dummy_forward(n)` runs one forward over n tokens; `probe_sampler()` runs the runner's
    sampler over `max_num_seqs` rows with top-k and top-p on; `probe_steps()` (runner V2) runs real
    steps against a probe KV cache and returns their activation peak in bytes (see
    `PeakWindow`); `probe_graphs()` (CUDA graphs on) returns (runner buffer bytes, graph pool
    bytes, captured batch sizes). Both probes leave nothing allocated. The activation peak is
    the larger of the dummy forward's and the probe steps'. Raises ParamError naming the flag
    when nothing is left for the KV cache or an explicit `--kv-cache-memory-bytes` does not fit
    beside the measured components.
    """
    config = runner.config
    block_bytes = int(runner.block_bytes)
    max_model_len = config.max_model_len or runner.model_config.max_position_embeddings
    if config.num_gpu_blocks is not None:
        breakdown = _unmeasured(runner, block_bytes, config.num_gpu_blocks, max_model_len)
        return MemoryProfile(identity=_identity(runner, max_model_len), memory=breakdown)
    if runner.device.type == "cuda":
        measured = _measure_cuda(runner, dummy_forward, probe_sampler, probe_graphs, probe_steps)
    else:
        measured = _measure_cpu(runner, dummy_forward, probe_sampler, probe_steps)
    (method, total, weights, activation, graphs, buffers, non_torch, sizes) = measured
    budget = int(total * config.gpu_memory_utilization)
    used = weights + activation + graphs + buffers + non_torch
    source: KvSource
    if config.kv_cache_memory_bytes is not None:
        source = "explicit"
        kv_bytes = int(config.kv_cache_memory_bytes)
        if used + kv_bytes > total:
            raise ParamError(
                "--kv-cache-memory-bytes",
                f"{kv_bytes} bytes of KV cache do not fit: {_gib(weights)} weights + "
                f"{_gib(activation)} activations + {_gib(graphs)} CUDA graphs + "
                f"{_gib(buffers)} runner buffers + {_gib(non_torch)} outside torch leave "
                f"{_gib(max(0, total - used))} of the device's {_gib(total)}",
            )
        if used + kv_bytes > budget:
            logger.warning(
                "--kv-cache-memory-bytes %d goes beyond --gpu-memory-utilization %.2f by %s",
                kv_bytes,
                config.gpu_memory_utilization,
                _gib(used + kv_bytes - budget),
            )
    else:
        source = "profile"
        kv_bytes = budget - used
        if method.startswith("cpu"):
            blocks_per_seq = -(-max_model_len // config.block_size)
            wanted = config.max_num_seqs * blocks_per_seq * block_bytes
            kv_bytes = min(kv_bytes, CPU_KV_CAP_BYTES, wanted)
        if kv_bytes < block_bytes:
            raise ParamError(
                "--gpu-memory-utilization",
                f"no memory left for the KV cache at {config.gpu_memory_utilization}: "
                f"{_gib(weights)} weights + {_gib(activation)} activations + {_gib(graphs)} "
                f"CUDA graphs + {_gib(buffers)} runner buffers + {_gib(non_torch)} outside "
                f"torch use {_gib(used)} of a {_gib(budget)} budget ({_gib(total)} total)",
            )
    num_blocks = kv_bytes // block_bytes
    if num_blocks < 1:
        raise ParamError(
            "--kv-cache-memory-bytes",
            f"{kv_bytes} bytes hold no KV block (one block takes {block_bytes} bytes)",
        )
    capacity = num_blocks * config.block_size
    breakdown = MemoryBreakdown(
        method=method,
        total_bytes=total,
        budget_bytes=budget,
        weights_bytes=weights,
        activation_peak_bytes=activation,
        cuda_graph_bytes=graphs,
        runner_buffer_bytes=buffers,
        non_torch_bytes=non_torch,
        kv_cache_bytes=kv_bytes,
        block_bytes=block_bytes,
        num_blocks=int(num_blocks),
        token_capacity=int(capacity),
        max_concurrency=round(capacity / max_model_len, 3),
        kv_source=source,
        cuda_graph_sizes=sizes,
    )
    profile = MemoryProfile(identity=_identity(runner, max_model_len), memory=breakdown)
    logger.info("memory profile: %s", profile.to_json())
    return profile


def with_num_blocks(profile: MemoryProfile, num_blocks: int) -> MemoryProfile:
    """`profile` holding `num_blocks` KV blocks (fewer than it measured room for): what a
    tensor-parallel rank keeps when another rank had room for fewer."""
    memory = profile.memory
    capacity = num_blocks * profile.identity.block_size
    return dataclasses.replace(
        profile,
        memory=dataclasses.replace(
            memory,
            kv_cache_bytes=num_blocks * memory.block_bytes,
            num_blocks=num_blocks,
            token_capacity=capacity,
            max_concurrency=round(capacity / profile.identity.max_model_len, 3),
        ),
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _unmeasured(
    runner: Any, block_bytes: int, num_blocks: int, max_model_len: int
) -> MemoryBreakdown:
    """`--num-gpu-blocks-override`: no measurement, only the block arithmetic."""
    capacity = num_blocks * runner.config.block_size
    return MemoryBreakdown(
        method="none",
        total_bytes=0,
        budget_bytes=0,
        weights_bytes=_weight_bytes(runner),
        activation_peak_bytes=0,
        cuda_graph_bytes=0,
        runner_buffer_bytes=0,
        non_torch_bytes=0,
        kv_cache_bytes=num_blocks * block_bytes,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        token_capacity=capacity,
        max_concurrency=round(capacity / max_model_len, 3),
        kv_source="override",
    )


def _weight_bytes(runner: Any) -> int:
    """The target's parameters, plus a speculative draft model's when the runner has one."""
    total = _parameter_bytes(runner.model)
    draft = getattr(runner, "draft", None)
    if draft is not None:
        total += _parameter_bytes(draft.model)
    return total


def _parameter_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


class PeakWindow:
    """Peak memory above the level at `start()`: torch's reserved memory on CUDA (what the
    caching allocator keeps, freed blocks included), the resident set on the CPU.

    `start()` returns False on the CPU when the kernel does not let the resident-set peak be
    reset; the peak then includes whatever the process reached before.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base = 0

    def start(self) -> bool:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return True
        self._base = _status_kib("VmRSS")
        return _reset_peak_rss()

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_reserved(self.device)
        else:
            peak = _status_kib("VmHWM")
        return max(0, int(peak) - self._base)


def _activation_peak(
    runner: Any,
    dummy_forward: Callable[[int], None],
    probe_sampler: Callable[[], None],
    probe_steps: Callable[[], int] | None,
) -> tuple[int, bool]:
    """(the larger activation peak, whether the resident-set peak could be reset)."""
    window = PeakWindow(runner.device)
    reset = window.start()
    dummy_forward(runner.config.max_num_batched_tokens)
    probe_sampler()
    dummy = window.peak_bytes()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    steps = probe_steps() if probe_steps is not None else 0
    logger.info(
        "activation peak: dummy forward + sampler %s, probe steps %s",
        _gib(dummy),
        _gib(steps) if probe_steps is not None else "not run",
    )
    return max(dummy, steps), reset


def _measure_cuda(
    runner: Any,
    dummy_forward: Callable[[int], None],
    probe_sampler: Callable[[], None],
    probe_graphs: Callable[[], tuple[int, int, tuple[int, ...]]] | None,
    probe_steps: Callable[[], int] | None,
) -> tuple[str, int, int, int, int, int, int, tuple[int, ...]]:
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_reserved(device)
    activation, _ = _activation_peak(runner, dummy_forward, probe_sampler, probe_steps)
    torch.cuda.empty_cache()
    buffers, graphs, sizes = probe_graphs() if probe_graphs is not None else (0, 0, ())
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return ("cuda", int(total), weights, activation, graphs, buffers, int(non_torch), sizes)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _cpu_total_bytes() -> int:
    """The cgroup's memory limit when one is set, else the machine's memory."""
    limit = Path("/sys/fs/cgroup/memory.max")
    try:
        text = limit.read_text().strip()
        if text != "max":
            return int(text)
    except (OSError, ValueError):
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _measure_cpu(
    runner: Any,
    dummy_forward: Callable[[int], None],
    probe_sampler: Callable[[], None],
    probe_steps: Callable[[], int] | None,
) -> tuple[str, int, int, int, int, int, int, tuple[int, ...]]:
    weights = _weight_bytes(runner)
    rss_before = _status_kib("VmRSS")
    activation, reset = _activation_peak(runner, dummy_forward, probe_sampler, probe_steps)
    method = "cpu-rss" if reset else "cpu-rss-unreset"
    non_torch = max(0, rss_before - weights)
    return (method, _cpu_total_bytes(), weights, activation, 0, 0, non_torch, ())


def _driver_version() -> str:
    """The NVIDIA driver version from the kernel module, else from NVML, else ""."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        text = ""
    for word in text.split():
        parts = word.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return word
    try:
        import pynvml
    except ImportError:
        return ""
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        logger.info("no driver version from NVML: %s", exc)
        return ""
    return version.decode() if isinstance(version, bytes) else str(version)


def _identity(runner: Any, max_model_len: int) -> ProfileIdentity:
    config = runner.config
    device = runner.device
    is_cuda = device.type == "cuda"
    props = torch.cuda.get_device_properties(device) if is_cuda else None
    return ProfileIdentity(
        engine_version=davit_engine.__version__,
        image_digest=os.environ.get(IMAGE_DIGEST_ENV, ""),
        model=config.model,
        model_revision=os.environ.get(MODEL_REVISION_ENV, ""),
        dtype=str(runner.dtype).removeprefix("torch."),
        device=device.type,
        gpu_product=props.name if props is not None else "",
        device_memory_bytes=int(props.total_memory) if props is not None else 0,
        driver_version=_driver_version() if is_cuda else "",
        cuda_version=(torch.version.cuda or "") if is_cuda else "",
        runner=runner.name,
        tensor_parallel_size=config.tensor_parallel_size,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        cuda_graphs=bool(getattr(runner, "use_graphs", False)),
        kv_cache_dtype=runner.loaded.kv_cache_dtype,
        quantization=runner.loaded.quantization,
        lm_head_quantization=runner.loaded.lm_head_quantization,
        fp8_block_scales=runner.loaded.fp8_block_scales,
    )
