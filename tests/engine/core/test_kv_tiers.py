"""The scheduler with lower KV tiers (simulated): loads instead of prefill, exact outputs,
waiting without blocking others, damaged blocks, aborts while loading, and the bookkeeping."""

from __future__ import annotations

import random

from davit_engine.core.request import RequestStatus
from davit_engine.core.scheduler import Scheduler
from davit_engine.types import EngineRequest, RequestDelta, SamplingParams
from tests.engine.core.sim import SimRunner, make_config, output_tokens, reference_outputs
from tests.engine.core.sim_tiers import FlushingRunner, SimTiers

BS = 4


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def setup(num_blocks: int, **tier_kwargs: object) -> tuple[Scheduler, FlushingRunner, SimTiers]:
    runner = SimRunner(num_blocks, BS)
    tiers = SimTiers(runner, **tier_kwargs)  # type: ignore[arg-type]
    scheduler = Scheduler(make_config(max_num_seqs=8), num_blocks, 512, tiers=tiers)
    return scheduler, FlushingRunner(runner, tiers), tiers


def drive(
    scheduler: Scheduler, runner: FlushingRunner, max_steps: int = 20_000
) -> dict[str, list[RequestDelta]]:
    deltas: dict[str, list[RequestDelta]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return deltas
        out = scheduler.schedule()
        scheduler.check_invariants()
        for delta in scheduler.update_from_output(out, runner.execute(out)):
            deltas.setdefault(delta.request_id, []).append(delta)
    raise AssertionError(f"not finished after {max_steps} steps")


def conversation(seed: int, num_turns: int) -> list[list[int]]:
    """Prompts of a conversation: each turn's prompt extends the previous one."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    prompt: list[int] = []
    for _ in range(num_turns):
        prompt = prompt + [rng.randrange(1, 1000) for _ in range(rng.randrange(9, 30))]
        prompts.append(prompt)
    return prompts


def test_returning_turns_load_their_prefix_and_match_the_reference() -> None:
    """Eight conversations, three turns each, on a GPU cache that holds about one of them:
    later turns find their prefix in the tier, compute only the rest, and every output
    equals the uncontended reference."""
    scheduler, runner, tiers = setup(num_blocks=40)
    convs = [conversation(seed, 3) for seed in range(8)]
    computed_without = 0
    outputs: dict[str, list[int]] = {}
    requests = []
    for turn in range(3):
        batch = [
            EngineRequest(f"c{c}-t{turn}", convs[c][turn], greedy(4)) for c in range(len(convs))
        ]
        requests += batch
        for req in batch:
            scheduler.add_request(req)
        for rid, deltas in drive(scheduler, runner).items():
            outputs[rid] = output_tokens(deltas)
        computed_without += sum(len(r.prompt_token_ids) + 3 for r in batch)
    assert outputs == reference_outputs(requests, 512)
    assert tiers.num_loaded > 0 and tiers.num_stored > 0
    # Loaded blocks were not computed again.
    assert runner.runner.num_computed_total <= computed_without - tiers.num_loaded * BS
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not tiers.loads and scheduler.num_loading == 0


def test_a_loading_request_waits_while_others_run() -> None:
    scheduler, runner, tiers = setup(num_blocks=64, load_polls=6)
    prefix = [7] * (BS * 5)
    tiers.blocks.clear()
    # Put the prefix into the tier: compute it once, then evict it from the GPU cache.
    scheduler.add_request(EngineRequest("first", [*prefix, 1], greedy(1)))
    drive(scheduler, runner)
    tiers.flush()
    scheduler.block_manager.reset_prefix_cache()
    scheduler.add_request(EngineRequest("back", [*prefix, 2], greedy(3)))
    scheduler.add_request(EngineRequest("other", [9, 9, 9], greedy(3)))
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["other"]  # "back" loads meanwhile
    assert scheduler.get_request("back").status is RequestStatus.LOADING  # type: ignore[union-attr]
    scheduler.update_from_output(out, runner.execute(out))
    deltas = drive(scheduler, runner)
    assert (
        output_tokens(deltas["back"])
        == reference_outputs([EngineRequest("back", [*prefix, 2], greedy(3))], 512)["back"]
    )
    first_row = [s for o in runner.runner.steps for s in o.scheduled if s.request_id == "back"][0]
    assert first_row.num_computed_tokens == len(prefix)  # the whole prefix came from the tier
    assert deltas["back"][0].num_cached_tokens == len(prefix)


def test_damaged_blocks_end_the_load_and_the_rest_is_computed() -> None:
    scheduler, runner, tiers = setup(num_blocks=64)
    prompt = list(range(1, BS * 6 + 2))
    scheduler.add_request(EngineRequest("a", prompt, greedy(2)))
    drive(scheduler, runner)
    tiers.flush()
    scheduler.block_manager.reset_prefix_cache()
    hashes = list(tiers.blocks)
    tiers.damaged.add(hashes[2])  # blocks 0 and 1 load intact, 2.. are computed
    scheduler.add_request(EngineRequest("b", prompt, greedy(2)))
    deltas = drive(scheduler, runner)
    assert (
        output_tokens(deltas["b"])
        == reference_outputs([EngineRequest("b", prompt, greedy(2))], 512)["b"]
    )
    first_row = [s for o in runner.runner.steps for s in o.scheduled if s.request_id == "b"][0]
    assert first_row.num_computed_tokens == 2 * BS
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_tier_that_starts_nothing_means_compute() -> None:
    scheduler, runner, tiers = setup(num_blocks=64)
    prompt = list(range(1, BS * 4 + 2))
    scheduler.add_request(EngineRequest("a", prompt, greedy(2)))
    drive(scheduler, runner)
    tiers.flush()
    scheduler.block_manager.reset_prefix_cache()
    tiers.refuse_loads = True
    scheduler.add_request(EngineRequest("b", prompt, greedy(2)))
    out = scheduler.schedule()
    assert [(s.request_id, s.num_computed_tokens) for s in out.scheduled] == [("b", 0)]
    scheduler.update_from_output(out, runner.execute(out))
    drive(scheduler, runner)
    # One lookup counted for "b" (the refused load does not count it twice).
    assert scheduler.stats().prefix_cache_queries == 2 * len(prompt)


def test_reused_registered_blocks_are_copied_before_the_step() -> None:
    """A tiny GPU cache: registered blocks are evicted and reused all the time, and each
    reuse forces the queued copies out before the next step (the sim checks the contents)."""
    scheduler, runner, tiers = setup(num_blocks=12)
    convs = [conversation(seed, 2) for seed in range(6)]
    requests = [
        EngineRequest(f"r{i}-{t}", convs[i][t], greedy(3)) for t in range(2) for i in range(6)
    ]
    for req in requests:
        scheduler.add_request(req)
    deltas = drive(scheduler, runner)
    assert {k: output_tokens(v) for k, v in deltas.items()} == reference_outputs(requests, 512)
    assert tiers.num_reuse_flushes > 0


def test_aborts_while_loading_free_every_block() -> None:
    """200 requests over shared prefixes, aborted at random (many while loading): every
    block ends free, no load is left, and the survivors match the reference."""
    rng = random.Random(5)
    scheduler, runner, tiers = setup(num_blocks=48, load_polls=3)
    prefixes = [conversation(seed, 1)[0] for seed in range(10)]
    requests = [
        EngineRequest(f"q{i}", prefixes[rng.randrange(10)] + [rng.randrange(1, 1000)], greedy(3))
        for i in range(200)
    ]
    pending = list(requests)
    aborted: set[str] = set()
    aborted_loading = 0
    outputs: dict[str, list[int]] = {}
    for _ in range(50_000):
        while pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        for req in requests:
            live = scheduler.get_request(req.request_id)
            if live is not None and rng.random() < 0.02:
                aborted_loading += live.status is RequestStatus.LOADING
                assert scheduler.abort(req.request_id)
                aborted.add(req.request_id)
        scheduler.check_invariants()
        for delta in scheduler.update_from_output(out, runner.execute(out)):
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert not scheduler.has_unfinished() and not pending
    assert aborted_loading > 0 and tiers.num_loaded > 0
    stats = scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not tiers.loads and scheduler.num_loading == 0
    survivors = [r for r in requests if r.request_id not in aborted]
    reference = reference_outputs(survivors, 512)
    assert {r.request_id: outputs[r.request_id] for r in survivors} == reference


def test_loading_requests_take_sequence_slots() -> None:
    runner = SimRunner(64, BS)
    tiers = SimTiers(runner, load_polls=100)
    scheduler = Scheduler(make_config(max_num_seqs=2), 64, 512, tiers=tiers)
    wrapped = FlushingRunner(runner, tiers)
    prompts = [[i] * (BS * 3) + [1] for i in (1, 2)]
    for i, prompt in enumerate(prompts):
        scheduler.add_request(EngineRequest(f"warm{i}", prompt, greedy(1)))
    drive(scheduler, wrapped)
    tiers.flush()
    scheduler.block_manager.reset_prefix_cache()
    for i, prompt in enumerate(prompts):
        scheduler.add_request(EngineRequest(f"load{i}", prompt, greedy(1)))
    scheduler.add_request(EngineRequest("third", [5, 5], greedy(1)))
    out = scheduler.schedule()
    assert out.is_empty and scheduler.num_loading == 2  # both slots are loading
    scheduler.check_invariants()
