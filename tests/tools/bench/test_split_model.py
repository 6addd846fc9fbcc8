"""The split model's pieces: program keys as the kernel splits them, list scheduling, and a
small workload through the engine's own split choice."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from davit_tools.bench import split_model
from davit_tools.bench.workloads import W1


def test_proportional_programs_cover_each_request_in_launch_order() -> None:
    keys = split_model.program_keys([100, 640, 1], num_kv_heads=2, num_splits=2, block_n=64)
    # requests fastest, then heads, then splits; tiles 2, 10, 1 in runs of 1, 5, 1
    assert keys == [64, 320, 64, 64, 320, 64, 64, 320, 0, 64, 320, 0]


@pytest.mark.parametrize("programs", [1, 7, 40, 10_000])
def test_balanced_programs_cover_every_tile_in_equal_runs(programs: int) -> None:
    contexts = [5, 900, 130, 64, 2000, 0]
    splits, heads = 6, 2
    keys = split_model.program_keys(contexts, heads, splits, 64, balanced_programs=programs)
    tiles = [math.ceil(c / 64) for c in contexts]
    assert sum(keys) == sum(tiles) * heads * 64  # every tile once per head
    run = max(math.ceil(sum(tiles) * heads / programs), math.ceil(max(tiles) / splits), 2)
    assert max(keys) == min(run, max(tiles)) * 64  # a run, or a whole request shorter
    longest = [keys[split * heads * len(contexts) + 4] for split in range(splits)]
    assert sum(longest) == tiles[4] * 64  # the longest request spread over its splits


def test_makespan_takes_the_first_free_slot() -> None:
    assert split_model.makespan([], 4, 10.0, 1.0) == 0.0
    assert split_model.makespan([100, 100, 100], 4, 10.0, 1.0) == 110.0  # one wave
    # two slots: 100 | 50 then 30 on the slot freed first (60 -> 100)
    assert split_model.makespan([100, 50, 30], 2, 10.0, 1.0) == 110.0
    assert split_model.makespan([0, 0, 0], 1, 10.0, 1.0) == 3.0  # empty programs


def test_a_small_workload_through_the_engine_split_choice() -> None:
    """Spread contexts cost more than the same at their mean; balanced splits cost less than
    the engine's proportional ones with an FP8 cache; the module's switches are restored."""
    from davit_engine.kernels import paged_attention as pa

    before = (pa.multiprocessors, dict(pa.SPLIT_WAVES), pa.BALANCE_SPLITS, dict(pa.BALANCED_WAVES))
    workload = dataclasses.replace(
        W1(), num_requests=40, input_len=(10, 900), output_len=(5, 40), max_num_seqs=64
    )
    figures = {
        way.name: split_model.run_way(workload, way, True, 8, 8, 80.0, 20.0, 20.0)
        for way in split_model.WAYS
    }
    assert figures["mean"] < figures["engine"]
    assert figures["balanced-3"] < figures["engine"]
    assert after_equal(before, pa)


def after_equal(before: tuple[object, ...], pa: Any) -> bool:
    return before == (
        pa.multiprocessors,
        dict(pa.SPLIT_WAVES),
        pa.BALANCE_SPLITS,
        dict(pa.BALANCED_WAVES),
    )


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        split_model.main(["--multiprocessors", "0"])
    assert "--multiprocessors" in capsys.readouterr().err
