"""Runner V2: one request's failure inside a step fails that request only, with and without
asynchronous scheduling and with speculative decoding.

The real EngineCore on a tiny random Qwen3 (fp32; on the CPU the Triton kernels run in the
interpreter, on a GPU with CUDA graphs) with a fault that one request's prompt triggers,
injected where a V2 step can fail: in input preparation once the host counted the step's
changes as sent but before they reached the device tables (so the state of every request in
the step is half-applied), inside the model forward once it wrote the step's K/V, after
sampling (or verification) committed the drawn tokens, and when a launched step's tokens are
read (while the next step is launched already). It fires from the faulty request's first
step, or only once it has decoded a few tokens. The faulty request ends with an ERROR delta;
every other request gets exactly the tokens of a run without it; after every step the device
tables agree with the scheduler; no slot or block leaks; the core keeps serving. And a failure
after which the device runs no more work stops the core with a DeviceFailure naming it,
without retries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pytest
import torch

from davit_engine import engine_core
from davit_engine.config import EngineConfig
from davit_engine.core.batch import RunnerOutput, ScheduledRequest, SchedulerOutput
from davit_engine.engine_core import EngineCore
from davit_engine.runner.base import DeviceFailure
from davit_engine.runner.v2 import runner as v2_runner
from davit_engine.runner.v2.graphs import DecodeGraphs
from davit_engine.runner.v2.pending import PendingStep
from davit_engine.runner.v2.speculative import SpecDecoder
from davit_engine.runner.v2.state import RequestStateTable
from davit_engine.spec_decode.config import speculative_config_from_json
from davit_engine.types import EngineRequest, FinishReason, RequestDelta, SamplingParams

from .test_isolating_runner import POISON

pytestmark = pytest.mark.slow

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_TOKENS = 6
PLACES = ("apply", "forward", "sample", "result")
K = 2  # draft tokens per verification (the "spec" mode)
DRAFT = "random:llama-tiny"


class FaultError(RuntimeError):
    """The injected failure."""


def is_poisoned(request: ScheduledRequest) -> bool:
    prompt = request.token_ids[: request.num_prompt_tokens]
    return any(prompt[i : i + 3] == [POISON] * 3 for i in range(len(prompt) - 2))


class Fault:
    """Raises FaultError at `place` in every V2 step holding a poisoned request that has at
    least `after` outputs before the step's token (placeholders of steps in flight included)."""

    def __init__(self, place: str, after: int = 0, error: Exception | None = None) -> None:
        self.place = place
        self.after = after
        self.error = error
        self.num_raised = 0
        self.batch: SchedulerOutput | None = None  # the step being run (for the forward)

    def fires(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        return any(is_poisoned(r) and r.num_output_tokens >= self.after for r in scheduled)

    def check(self, place: str, scheduled: Sequence[ScheduledRequest]) -> None:
        if place == self.place and self.fires(scheduled):
            self.num_raised += 1
            raise self.error or FaultError(f"fault injected at {place}")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        fault = self
        stage, sample_step = RequestStateTable.stage, v2_runner.sample_step
        verify, apply = SpecDecoder.verify, RequestStateTable._apply
        execute_async = v2_runner.RunnerV2.execute_async

        def staged(table: RequestStateTable, batch: SchedulerOutput, *args: Any, **kw: Any) -> Any:
            fault.batch = batch
            return stage(table, batch, *args, **kw)

        def applied(table: RequestStateTable, *args: Any, **kw: Any) -> Any:
            # The host's bookkeeping of the step is done, the device tables are not updated.
            if fault.batch is not None:
                fault.check("apply", fault.batch.scheduled)
            return apply(table, *args, **kw)

        def sampled(*args: Any, **kw: Any) -> Any:
            drawn = sample_step(*args, **kw)  # committed into the state table already
            fault.check("sample", args[3])
            return drawn

        def verified(decoder: SpecDecoder, *args: Any, **kw: Any) -> Any:
            verdicts = verify(decoder, *args, **kw)  # the verifying rows' sampling
            fault.check("sample", args[3])
            return verdicts

        def launched(runner: v2_runner.RunnerV2, batch: SchedulerOutput) -> PendingStep:
            pending = execute_async(runner, batch)
            if fault.place == "result" and fault.fires(batch.scheduled):
                read = pending.result

                def result() -> RunnerOutput:
                    read()  # the tokens did arrive; reading them is what fails
                    fault.check("result", batch.scheduled)
                    return read()

                pending.result = result  # type: ignore[method-assign]
            return pending

        def forwarding(run: Callable[..., Any]) -> Callable[..., Any]:
            def forwarded(*args: Any, **kw: Any) -> Any:
                out = run(*args, **kw)  # the forward ran: its K/V are written
                if fault.batch is not None:
                    fault.check("forward", fault.batch.scheduled)
                return out

            return forwarded

        monkeypatch.setattr(RequestStateTable, "stage", staged)
        monkeypatch.setattr(RequestStateTable, "_apply", applied)
        monkeypatch.setattr(v2_runner, "sample_step", sampled)
        monkeypatch.setattr(SpecDecoder, "verify", verified)
        monkeypatch.setattr(v2_runner.RunnerV2, "execute_async", launched)
        # The forward of eager steps, and the replay of a captured one (CUDA graphs).
        for owner, name in (
            (v2_runner.RunnerV2, "_mixed_hidden"),
            (v2_runner.RunnerV2, "_decode_logits"),
            (DecodeGraphs, "replay"),
        ):
            monkeypatch.setattr(owner, name, forwarding(getattr(owner, name)))


def make_config(async_scheduling: bool, **overrides: Any) -> EngineConfig:
    config = EngineConfig(
        model="random:qwen3-tiny",
        runner="v2",
        device=DEVICE.type,
        dtype="float32",
        num_gpu_blocks=48,
        block_size=8,
        max_num_seqs=6,
        max_num_batched_tokens=20,  # the longer prompts are prefilled in chunks
        max_model_len=128,
        async_scheduling=async_scheduling,
    )
    return dataclasses.replace(config, **overrides)


def v2_core(config: EngineConfig) -> EngineCore:
    """The engine core with runner V2 on any device: on the CPU, where the engine picks V1, its
    Triton kernels run in the interpreter, as the runner's own tests run them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_core, "select_runner", lambda *_: ("v2", "chosen by the test"))
        return EngineCore(config)


def prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(5)
    phrase = torch.randint(0, 500, (6,), generator=gen).tolist()
    lengths = {"a": 27, "b": 9, "c": 14, "d": 5}
    made = {
        name: torch.randint(0, 500, (n,), generator=gen).tolist() for name, n in lengths.items()
    }
    made["poisoned"] = [5, POISON, POISON, POISON, 6, *phrase]
    return made


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def run(
    core: EngineCore, requests: dict[str, list[int]], late: dict[str, list[int]] | None = None
) -> dict[str, list[RequestDelta]]:
    """Run `requests` (and `late` ones, added after two steps) to the end; then one more step
    hands the last finished ids to the runner."""
    deltas: dict[str, list[RequestDelta]] = {}
    for rid, prompt in requests.items():
        core.add_request(EngineRequest(rid, prompt, GREEDY))
    added = [*requests, *(late or ())]
    num_steps = 0
    while core.has_unfinished_requests() or late:
        if num_steps == 2 and late:
            for rid, prompt in late.items():
                core.add_request(EngineRequest(rid, prompt, GREEDY))
            late = None
        for delta in core.step():
            deltas.setdefault(delta.request_id, []).append(delta)
        core.scheduler.check_invariants()
        assert_device_state(core, added)
        num_steps += 1
    core.step()
    return deltas


def assert_device_state(core: EngineCore, request_ids: Iterable[str]) -> None:
    """Runner V2's device tables agree with the scheduler for every running request: its block
    table starts with the request's blocks and its token row with the request's tokens (the row
    may hold more: tokens of a step still in flight). A failure that left them half-written and
    was not rebuilt shows here even where the output happens to come out right."""
    state = core.runner.state  # type: ignore[attr-defined]
    for request_id in request_ids:
        request = core.scheduler.get_request(request_id)
        if request is None:
            continue  # finished
        try:
            slot = state.slot_of(request_id)
        except KeyError:
            continue  # waiting, preempted or loading: no slot
        if request.status.value != "running":
            continue
        num_blocks = len(request.block_ids)
        assert state.block_table[slot, :num_blocks].tolist() == request.block_ids, request_id
        num_tokens = len(request.token_ids)
        assert state.token_ids[slot, :num_tokens].tolist() == request.token_ids, request_id


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def assert_clean(core: EngineCore) -> None:
    """No request, block or V2 slot left."""
    stats = core.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    state = core.runner.state  # type: ignore[attr-defined]
    assert state.num_free_slots == core.config.max_num_seqs


CORES: dict[str, EngineCore] = {}
REFERENCES: dict[str, dict[str, list[int]]] = {}


@pytest.fixture(scope="module")
def cores() -> Iterator[Callable[[str], EngineCore]]:
    """One engine core per mode ("sync", "async", "spec"), built when first asked for."""

    def get(mode: str) -> EngineCore:
        if mode not in CORES:
            spec = None
            if mode == "spec":
                # Another random model as the draft: drafts every step, some rejected.
                spec = speculative_config_from_json(
                    {"method": "draft_model", "num_speculative_tokens": K, "model": DRAFT}
                )
            CORES[mode] = v2_core(make_config(mode != "sync", speculative_config=spec))
        return CORES[mode]

    try:
        yield get
    finally:
        for core in CORES.values():
            core.shutdown()
        CORES.clear()
        REFERENCES.clear()


def reference(core: EngineCore, mode: str) -> dict[str, list[int]]:
    """The good requests' tokens in a run without the poisoned one (and without a fault)."""
    if mode not in REFERENCES:
        good = {k: v for k, v in prompts().items() if k != "poisoned"}
        REFERENCES[mode] = {rid: tokens(d) for rid, d in run(core, good).items()}
        assert_clean(core)
    return REFERENCES[mode]


# Verification steps happen mid-decode only: the spec mode's faults fire there.
CASES = [
    pytest.param(mode, place, after, id=f"{mode}-{place}-{'mid-decode' if after else 'prefill'}")
    for mode in ("sync", "async", "spec")
    for place in PLACES
    for after in ((0, 2) if mode != "spec" else (2,))
]


@pytest.mark.parametrize(("mode", "place", "after"), CASES)
def test_the_poisoned_request_fails_alone_and_the_others_are_unchanged(
    cores: Callable[[str], EngineCore],
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    place: str,
    after: int,
) -> None:
    core = cores(mode)
    expected = reference(core, mode)
    fault = Fault(place, after)
    fault.install(monkeypatch)
    made = prompts()
    poisoned = {"poisoned": made.pop("poisoned")}
    deltas = run(core, made, late=poisoned)

    assert fault.num_raised >= 1
    failed = deltas["poisoned"]
    assert failed[-1].finish_reason is FinishReason.ERROR
    assert failed[-1].error == "FaultError"
    assert [d.finish_reason for d in failed[:-1]] == [None] * (len(failed) - 1)
    # The steps before the fault delivered theirs (a verification up to K + 1 at once).
    num_delivered = len(tokens(failed))
    assert after <= num_delivered <= after + (K if mode == "spec" else 0)
    for rid, reference_tokens in expected.items():
        assert tokens(deltas[rid]) == reference_tokens, rid
        assert deltas[rid][-1].finish_reason is FinishReason.LENGTH
    assert_clean(core)
    if mode == "spec":
        assert core.runner.spec.num_verify_steps > 0  # type: ignore[attr-defined]
    # The core keeps serving, with the fault still installed.
    again = run(core, {"after": made["b"]})
    assert tokens(again["after"]) == expected["b"]
    assert_clean(core)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="simulates a broken CUDA device; on a GPU, test_device_failure_cuda breaks a real one",
)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_device_that_runs_no_more_work_stops_the_core(
    monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    """A sticky device error (here the CUDA calls of the device check fail as after an illegal
    memory access) is nobody's request: no request runs again, the core stops naming it."""
    core = v2_core(make_config(async_scheduling))
    try:
        sticky = "CUDA error: an illegal memory access was encountered"
        fault = Fault("sample", 2, RuntimeError(f"{sticky}\nCompile with TORCH_USE_CUDA_DSA"))
        fault.install(monkeypatch)
        broken = False

        def synchronize(*_: Any) -> None:
            if broken:
                raise RuntimeError(sticky)

        check = fault.check

        def check_and_break(place: str, scheduled: Sequence[ScheduledRequest]) -> None:
            nonlocal broken
            try:
                check(place, scheduled)
            except RuntimeError:
                broken = True
                raise

        monkeypatch.setattr(fault, "check", check_and_break)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: broken)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: broken)
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
        made = prompts()
        with pytest.raises(DeviceFailure) as raised:
            run(core, made)
        message = str(raised.value)
        assert "illegal memory access" in message and "restart" in message
        assert "not one request's failure" in message
        assert fault.num_raised == 1  # nothing ran again on the broken device
    finally:
        monkeypatch.undo()
        core.shutdown()
