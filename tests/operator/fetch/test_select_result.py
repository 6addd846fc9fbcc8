"""Which files are fetched, and the documents the fetcher and the operator exchange."""

from __future__ import annotations

import json

from davit_operator.fetch.result import (
    MAX_LISTED_FILES,
    MESSAGE_LIMIT,
    PERMANENT_EXIT,
    TRANSIENT_EXIT,
    FetchFailure,
    FetchResult,
    FileRecord,
    Progress,
    parse_outcome,
    parse_progress,
)
from davit_operator.fetch.select import has_weights, is_needed, needed

# A real repository's listing (Qwen3-8B-like, with extras that serving never reads).
REPOSITORY = [
    ".gitattributes",
    "LICENSE",
    "README.md",
    "config.json",
    "generation_config.json",
    "hf_quant_config.json",
    "merges.txt",
    "model-00001-of-00005.safetensors",
    "model-00005-of-00005.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "chat_template.jinja",
    "onnx/model.onnx",
    "original/consolidated.safetensors",
    "pytorch_model.bin",
    "model.gguf",
    "figures/benchmark.png",
]


def test_only_what_serving_reads_is_fetched() -> None:
    assert needed(REPOSITORY) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "hf_quant_config.json",
        "merges.txt",
        "model-00001-of-00005.safetensors",
        "model-00005-of-00005.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
    ]
    # Sub-folders hold other formats or other checkpoints: never fetched.
    assert not is_needed("original/consolidated.safetensors")
    assert not is_needed("onnx/model.onnx") and not is_needed("pytorch_model.bin")


def test_weights_are_root_safetensors() -> None:
    assert has_weights(needed(REPOSITORY))
    assert not has_weights(needed(["config.json", "pytorch_model.bin", "sub/w.safetensors"]))


def test_a_result_round_trips_through_the_termination_message() -> None:
    files = [
        FileRecord(f"model-{i:05d}.safetensors", 5 << 30, "sha256:" + "a" * 64) for i in range(40)
    ]
    result = FetchResult(
        source="hf://Org/Model",
        revision="main",
        commit="c" * 40,
        path="hf/models--Org--Model/snapshots/" + "c" * 40,
        bytes_total=200 << 30,
        bytes_fetched=17,
        files=files,
    )
    text = result.to_json()
    assert len(text.encode()) <= MESSAGE_LIMIT
    doc = json.loads(text)
    assert doc["numFiles"] == 40 and len(doc["files"]) == MAX_LISTED_FILES
    parsed = parse_outcome(text)
    assert isinstance(parsed, FetchResult)
    assert parsed.bytes_total == 200 << 30 and parsed.bytes_fetched == 17
    assert parsed.files == files[:MAX_LISTED_FILES]


def test_a_failure_round_trips_and_long_messages_are_cut() -> None:
    failure = FetchFailure("Unauthorized", "401 " + "x" * 10_000)
    text = failure.to_json()
    assert len(text.encode()) <= MESSAGE_LIMIT
    parsed = parse_outcome(text)
    assert isinstance(parsed, FetchFailure) and parsed.reason == "Unauthorized"
    assert parsed.message.startswith("401 x") and parsed.message.endswith("...")


def test_which_failures_are_permanent() -> None:
    assert PERMANENT_EXIT != TRANSIENT_EXIT and 0 not in (PERMANENT_EXIT, TRANSIENT_EXIT)
    for reason in ("RevisionNotFound", "Unauthorized", "ChecksumMismatch", "DiskFull"):
        assert FetchFailure(reason, "m").permanent, reason  # type: ignore[arg-type]
    assert not FetchFailure("Transient", "m").permanent


def test_what_is_neither_a_result_nor_a_failure() -> None:
    for text in ("", "Error: killed", "[]", '{"kind": "result"}', '{"kind": "other"}'):
        assert parse_outcome(text) is None, text
    assert parse_progress('{"bytes_done": 1}') is None and parse_progress("nope") is None
    progress = Progress(5, 10, 1, 3, "model.safetensors")
    assert parse_progress(progress.to_json()) == progress
