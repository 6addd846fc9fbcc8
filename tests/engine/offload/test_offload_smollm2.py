"""The reference model (SmolLM2-135M, CPU, fp32) answers token for token the same whether a
prompt's prefix is computed, loaded from the CPU tier or loaded from the disk tier."""

from __future__ import annotations

from pathlib import Path

from davit_engine.llm import LLM
from davit_engine.types import SamplingParams

DOCUMENT = (
    "The Rhine is a river that begins in the Swiss Alps, forms part of the border between "
    "Switzerland and Liechtenstein, then Switzerland and Austria, and later Germany and "
    "France, before flowing through Germany and the Netherlands into the North Sea. It is "
    "one of the most important waterways in Europe, carrying barges loaded with coal, grain "
    "and containers between the port of Rotterdam and the industrial cities upstream. Its "
    "valley holds castles, vineyards and old towns, and its water feeds farms and factories."
)
FILLER = " ".join(
    f"Item {i} is a number that follows {i - 1} and precedes {i + 1}." for i in range(40)
)


def test_prefix_from_cpu_and_from_disk_gives_the_same_tokens(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2's KV block in fp32
    llm = LLM(
        str(smollm2_gguf),
        device="cpu",
        dtype="float32",
        num_gpu_blocks=24,
        kv_offloading_size=32 * block_bytes / 2**30,  # two more fillers push it to disk
        kv_offload_disk_path=str(tmp_path),
        kv_offload_disk_bytes=200 * block_bytes,
    )
    tiers = llm.core.tiers
    assert tiers is not None
    params = SamplingParams(max_tokens=24, temperature=0.0)
    question = llm.tokenizer.encode(
        f"{DOCUMENT}\n\nQuestion: which sea does the river reach? Answer:"
    )
    filler = llm.tokenizer.encode(FILLER)[:360]
    assert len(question) > 6 * 16 and len(filler) > 16 * 21

    def ask() -> tuple[list[int], int]:
        computed = llm.core.runner.num_computed_tokens_total  # type: ignore[attr-defined]
        (out,) = llm.generate([question], params)
        return out.token_ids, llm.core.runner.num_computed_tokens_total - computed  # type: ignore[attr-defined]

    def loaded() -> dict[str, int]:
        tiers.drain()
        return {s.tier: s.load_bytes for s in tiers.stats()}

    computed_tokens, computed_work = ask()  # nothing cached anywhere: computed
    llm.generate([filler], SamplingParams(max_tokens=1))  # evicts the prefix from the GPU
    assert loaded() == {"cpu": 0, "disk": 0}
    from_cpu, cpu_work = ask()
    assert loaded()["cpu"] > 0 and loaded()["disk"] == 0
    for other in (filler[::-1], filler[::2] + filler[1::2]):  # out of the CPU tier too
        llm.generate([other], SamplingParams(max_tokens=1))
    from_disk, disk_work = ask()
    assert loaded()["disk"] > 0
    num_full_blocks = (len(question) - 1) // 16
    assert from_cpu == computed_tokens and from_disk == computed_tokens
    assert computed_work - cpu_work == num_full_blocks * 16
    assert computed_work - disk_work == num_full_blocks * 16
    llm.shutdown()
    assert tiers.is_idle()
