"""Decode graphs share one float32 logits buffer: every replay returns rows of it, the logits
are those of the eager step, and the runner samples them before the next replay overwrites them.

The capture itself needs CUDA (the GPU test); on the CPU `EagerGraphs` replays by running the
captured step again, which exercises the same step, buffer and runner path without a graph.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from davit_contract.graphs import graph_batch_sizes
from davit_engine.config import EngineConfig
from davit_engine.core.batch import SchedulerOutput
from davit_engine.core.scheduler import Scheduler
from davit_engine.loader import LoadedModel, load_model
from davit_engine.runner.v2 import RunnerV2
from davit_engine.runner.v2.graphs import DecodeGraphs
from davit_engine.types import EngineRequest, SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_BLOCKS = 64


def _config(**overrides: object) -> EngineConfig:
    base = EngineConfig(
        model="random:qwen3-tiny",
        dtype="float32",
        device=DEVICE.type,
        num_gpu_blocks=NUM_BLOCKS,
        block_size=8,
        max_num_seqs=12,  # graph sizes 1, 2, 4, 8, 12
        max_num_batched_tokens=64,
        max_model_len=128,
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


class _Rerun:
    def __init__(self, graphs: EagerGraphs, size: int) -> None:
        self.graphs = graphs
        self.size = size

    def replay(self) -> None:
        self.graphs.num_replays += 1
        self.graphs.step(self.size, self.graphs.logits[: self.size])


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose 'capture' keeps the step itself: a replay runs it again."""

    def __init__(self, runner: RunnerV2) -> None:
        sizes = graph_batch_sizes(runner.config.max_num_seqs)
        super().__init__(runner._graph_step, sizes, runner.model_config.vocab_size, DEVICE)
        self.step = runner._graph_step
        self.num_replays = 0

    def capture(self) -> None:
        for size in self.sizes:
            self._graphs[size] = _Rerun(self, size)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(_config(), DEVICE)


def _generate(runner: RunnerV2, config: EngineConfig, lengths: list[int]) -> dict[str, list[int]]:
    scheduler = Scheduler(config, NUM_BLOCKS, 128)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    gen = torch.Generator().manual_seed(3)
    for i, n in enumerate(lengths):
        prompt = torch.randint(0, 512, (n,), generator=gen).tolist()
        scheduler.add_request(EngineRequest(f"r{i}", prompt, params))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(lengths))}
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        for delta in scheduler.update_from_output(batch, runner.execute(batch)):
            outputs[delta.request_id].extend(delta.new_token_ids)
    runner.execute(SchedulerOutput(finished_ids=list(outputs)))
    return outputs


def test_graph_path_samples_from_the_shared_buffer(loaded: LoadedModel) -> None:
    """Decode steps of 3, 5 and 9 rows replay sizes 4, 8 and 12 out of one buffer; the tokens
    match a runner without graphs, so each step sampled its own logits."""
    config = _config()
    eager = RunnerV2(config, loaded, DEVICE)
    eager.use_graphs = False
    eager.initialize_kv_cache(NUM_BLOCKS)
    lengths = [5, 9, 3, 11, 7, 4, 6, 8, 10]
    expected = {n: _generate(eager, config, lengths[:n]) for n in (3, 5, 9)}

    runner = RunnerV2(config, loaded, DEVICE)
    runner.use_graphs = False
    runner.initialize_kv_cache(NUM_BLOCKS)
    graphs = EagerGraphs(runner)
    graphs.capture()
    runner.graphs = graphs
    assert graphs.logits.shape == (12, 512) and graphs.logits.dtype == torch.float32
    assert graphs.logits_bytes == 12 * 512 * 4
    for n in (3, 5, 9):
        before = graphs.num_replays
        assert _generate(runner, config, lengths[:n]) == expected[n]
        assert graphs.num_replays - before >= 5  # 6 outputs: the decodes replayed
    assert runner.num_graph_steps == graphs.num_replays
    for size in graphs.sizes:
        out = graphs.replay(size)
        assert out.shape == (size, 512)
        assert out.data_ptr() == graphs.logits.data_ptr()  # one buffer for every size


def test_graph_step_writes_the_eager_logits(loaded: LoadedModel) -> None:
    """The captured step's logits (lm_head converted into the buffer) equal the eager
    step's (`compute_logits`), and a smaller step leaves the rows beyond it alone."""
    config = _config()
    runner = RunnerV2(config, loaded, DEVICE)
    runner.use_graphs = False
    runner.initialize_kv_cache(NUM_BLOCKS)
    graphs = DecodeGraphs(runner._graph_step, [4, 8], 512, DEVICE)
    # Rows on the padding slot: every size reads the same (empty) state.
    with torch.inference_mode():
        runner._graph_step(8, graphs.logits[:8])
        wide = graphs.logits.clone()
        graphs.logits[4:].fill_(7.0)
        runner._graph_step(4, graphs.logits[:4])
        eager = runner._decode_logits(4, 1)
    torch.testing.assert_close(graphs.logits[:4], eager)
    # another batch size may take other GEMM kernels on a GPU: close, not bitwise
    torch.testing.assert_close(graphs.logits[:4], wide[:4], rtol=1e-3, atol=1e-3)
    assert bool((graphs.logits[4:] == 7.0).all())


@pytest.mark.gpu
def test_captured_graphs_share_the_buffer(loaded: LoadedModel) -> None:
    """Real CUDA graphs: replays of every size return rows of one buffer, a smaller replay
    leaves the rows beyond it alone, and greedy decoding matches the eager runner."""
    config = _config()
    runner = RunnerV2(config, loaded, DEVICE)
    runner.initialize_kv_cache(NUM_BLOCKS)  # captures
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 12]
    with torch.inference_mode():
        # Fresh state: every row sits on the padding slot, so every row has the same logits.
        wide = graphs.replay(12).clone()
        graphs.logits[4:].fill_(7.0)
        small = graphs.replay(4)
        torch.cuda.synchronize()
    assert small.data_ptr() == graphs.logits.data_ptr()
    torch.testing.assert_close(small, wide[:4], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(wide, wide[:1].expand_as(wide), rtol=1e-3, atol=1e-3)
    assert bool((graphs.logits[4:] == 7.0).all())
    eager = RunnerV2(config, loaded, DEVICE)
    eager.use_graphs = False
    eager.initialize_kv_cache(NUM_BLOCKS)
    lengths = [5, 9, 3, 11, 7]
    assert _generate(runner, config, lengths) == _generate(eager, config, lengths)
    assert runner.num_graph_steps > 0


@pytest.mark.gpu
def test_balanced_split_graphs_keep_the_tokens(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Graphs captured with balanced split decodes (`BALANCE_SPLITS`: runs computed on the GPU
    from each replay's lengths) decode the tokens of the eager runner with proportional
    splits, over prompts of very different lengths."""
    from davit_engine.kernels import paged_attention

    config = _config()
    eager = RunnerV2(config, loaded, DEVICE)
    eager.use_graphs = False
    eager.initialize_kv_cache(NUM_BLOCKS)
    lengths = [5, 9, 3, 11, 7, 40, 60]
    expected = _generate(eager, config, lengths)
    monkeypatch.setattr(paged_attention, "BALANCE_SPLITS", True)
    runner = RunnerV2(config, loaded, DEVICE)
    runner.initialize_kv_cache(NUM_BLOCKS)
    assert _generate(runner, config, lengths) == expected
    assert runner.num_graph_steps > 0
