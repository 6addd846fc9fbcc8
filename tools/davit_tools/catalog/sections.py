"""The evidence file's sections read from one wheel, as the plain data the schema validates.

One builder per section (`artifact`, `runner_classes`, `switch`, `selection`, `feature_lists`,
`guards`, `platform_predicates`, `flag_lookup`, `speculative_methods`, `precision`,
`pass_config`, `build_facts`); each
names the file inside the wheel it read (`source`) and marks the facts `verified`.
"""

from __future__ import annotations

import re

from davit_tools.catalog import build, features, flags, passconfig, runners
from davit_tools.catalog.command_lines import (
    operator_precision_values,
    operator_speculative_methods,
)
from davit_tools.catalog.summary import list_role
from davit_tools.catalog.wheel import ReleaseWheel

SPECULATIVE = "vllm/config/speculative.py"
# Where `--quantization` and `--kv-cache-dtype` take their values from (`QuantizationMethods`,
# `CacheDType`: the Literals the engine arguments are typed with)
QUANTIZATION = "vllm/model_executor/layers/quantization/__init__.py"
CACHE = "vllm/config/cache.py"


def _version_commit(wheel: ReleaseWheel) -> str | None:
    if not wheel.has("vllm/_version.py"):
        return None
    match = re.search(r"commit_id\s*=\s*['\"]([^'\"]+)['\"]", wheel.read_text("vllm/_version.py"))
    return match[1] if match else None


def _wheel_tags(wheel: ReleaseWheel) -> list[str]:
    text = wheel.read_text(f"{wheel.dist_info}/WHEEL")
    return sorted(
        line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Tag:")
    )


def artifact(wheel: ReleaseWheel) -> dict[str, object]:
    return {
        "filename": wheel.filename,
        "sha256": wheel.sha256,
        "sizeBytes": wheel.path.stat().st_size,
        "metadataVersion": wheel.version,
        "commit": _version_commit(wheel),
        "requiresPython": next(iter(wheel.metadata.get("Requires-Python", [])), None),
        "wheelTags": _wheel_tags(wheel),
        "source": wheel.metadata_path,
        "verified": True,
    }


def runner_classes(wheel: ReleaseWheel) -> dict[str, object]:
    shipped = runners.shipped_runners(wheel)
    return {
        "shipped": [
            {
                "kind": r.kind,
                "device": r.device,
                "className": r.class_name,
                "source": r.source,
                "line": r.line,
                "lineage": r.lineage,
            }
            for r in shipped
        ],
        "hasV1": any(r.kind == "v1" and r.device == "gpu" for r in shipped),
        "hasV2": any(r.kind == "v2" and r.device == "gpu" for r in shipped),
        "source": runners.WORKER_DIR,
        "verified": True,
    }


def switch(wheel: ReleaseWheel) -> dict[str, object]:
    found = runners.runner_switch(wheel)
    return {
        "name": found.name,
        "declared": found.declared,
        "parse": found.parse,
        "default": found.default,
        "readers": found.readers,
        "messages": [{"source": s, "line": n, "text": t} for s, n, t in found.messages],
        "source": runners.ENVS,
        "verified": True,
    }


def selection(wheel: ReleaseWheel) -> dict[str, object]:
    decision = features.decision(wheel)
    steps = sorted(decision[1], key=lambda s: s.line) if decision else []
    return {
        "method": decision[0] if decision else None,
        "steps": [
            {"condition": s.condition, "outcome": s.outcome, "line": s.line, "where": s.where}
            for s in steps
        ],
        "validations": [
            {"method": v.method, "call": v.text, "condition": v.condition, "line": v.line}
            for v in features.validations(wheel)
        ],
        "source": features.CONFIG,
        "verified": True,
    }


def feature_lists(wheel: ReleaseWheel) -> list[dict[str, object]]:
    return [
        {
            "method": f.method,
            "role": list_role(f.method),
            "line": f.line,
            "extendedBy": f.extended_by,
            "consumers": [
                {
                    "method": c.method,
                    "condition": c.condition,
                    "outcome": c.outcome,
                    "line": c.line,
                    "whenEmpty": c.when_empty,
                }
                for c in f.consumers
            ],
            "items": [
                {
                    "text": i.text,
                    "condition": i.condition,
                    "line": i.line,
                    "method": i.method,
                    "catalogFeature": features.catalog_feature(i.text),
                }
                for i in f.items
            ],
            "source": features.CONFIG,
            "verified": True,
        }
        for f in features.feature_lists(wheel)
    ]


def runner_reads(wheel: ReleaseWheel) -> dict[str, object]:
    return {"reads": features.runner_reads(wheel), "source": "vllm/v1/worker/", "verified": True}


def guards(wheel: ReleaseWheel) -> list[dict[str, object]]:
    return [
        {
            "needs": features.needs_runner(g),
            "source": g.source,
            "method": g.method,
            "line": g.line,
            "condition": g.condition,
            "message": g.text,
            "verified": True,
        }
        for g in features.runner_guards(wheel)
    ]


def platform_predicates(
    wheel: ReleaseWheel, lists: list[dict[str, object]]
) -> list[dict[str, object]]:
    conditions = [
        str(c["condition"])
        for f in lists
        for c in f["consumers"]  # type: ignore[attr-defined]
    ]
    return [
        {
            "source": p.source,
            "method": p.method,
            "line": p.line,
            "condition": p.condition,
            "returns": p.text,
            "verified": True,
        }
        for p in features.platform_predicates(wheel, conditions)
    ]


def flag_lookup(wheel: ReleaseWheel, wanted: list[str]) -> dict[str, object]:
    known = flags.release_flags(wheel)
    out: dict[str, object] = {}
    for flag in wanted:
        found = known.get(flag)
        out[flag] = {
            "exists": found is not None,
            "how": found.how if found else None,
            "source": found.source if found else None,
            "line": found.line if found else None,
            "note": found.note if found else "",
        }
    return {"flags": out, "source": flags.ARG_UTILS, "verified": True}


def speculative_methods(wheel: ReleaseWheel) -> dict[str, object] | None:
    if not wheel.has(SPECULATIVE):
        return None
    known = flags.literal_values(wheel, SPECULATIVE, "SpeculativeMethod")
    return {
        "known": sorted(known),
        "operator": {m: m in known for m in operator_speculative_methods()},
        "source": SPECULATIVE,
        "verified": True,
    }


def precision(wheel: ReleaseWheel) -> dict[str, object] | None:
    """The release's `--quantization` methods and `--kv-cache-dtype` values, and per value of
    the operator's fields whether the release names it; None where either file is missing."""
    if not (wheel.has(QUANTIZATION) and wheel.has(CACHE)):
        return None
    wanted = operator_precision_values()

    def values(path: str, name: str, field: str) -> dict[str, object]:
        known = flags.literal_values(wheel, path, name)
        return {
            "known": sorted(known),
            "operator": {v: v in known for v in wanted[field]},
            "source": path,
        }

    return {
        "quantization": values(QUANTIZATION, "QuantizationMethods", "quantization"),
        "kvCacheDtypes": values(CACHE, "CacheDType", "kvCacheDtype"),
        "verified": True,
    }


def pass_config(wheel: ReleaseWheel) -> dict[str, object] | None:
    found = passconfig.config_fields(wheel, passconfig.CLASS)
    if found is None:
        return None
    path, line, fields = found
    return {
        "className": passconfig.CLASS,
        "line": line,
        "fields": [
            {"name": f.name, "annotation": f.annotation, "line": f.line, "doc": f.doc}
            for f in fields
        ],
        "sequenceParallelismKey": passconfig.sequence_parallelism_key(fields),
        "source": path,
        "verified": True,
    }


def build_facts(wheel: ReleaseWheel) -> dict[str, object]:
    libraries = build.native_libraries(wheel)
    majors = sorted({lib.cudart_major for lib in libraries if lib.cudart_major is not None})
    releases = sorted({r for lib in libraries for r in lib.nvcc_releases})
    pins = build.pins(wheel)
    torch_wheel = build.torch_wheel(pins["torch"]) if pins["torch"] else None
    return {
        "cuda": {
            "version": releases[0] if len(releases) == 1 else None,
            "cudartMajor": majors[0] if len(majors) == 1 else None,
            "libraries": [
                {
                    "member": lib.member,
                    "cudartMajor": lib.cudart_major,
                    "nvccReleases": lib.nvcc_releases,
                }
                for lib in libraries
            ],
            "cudaTaggedRequirements": build.cuda_tagged_requirements(wheel),
            "source": "vllm/*.so (DT_NEEDED, nvcc identification strings); " + wheel.metadata_path,
            "verified": True,
        },
        "pins": {**pins, "source": wheel.metadata_path, "verified": True},
        "torchWheel": (
            {
                "filename": torch_wheel.filename,
                "sha256": torch_wheel.sha256,
                "cudaToolkit": torch_wheel.cuda_toolkit,
                "triton": torch_wheel.triton,
                "requires": torch_wheel.requires,
                "source": f"{torch_wheel.filename} METADATA (pip install --dry-run --report)",
                "verified": True,
            }
            if torch_wheel
            else None
        ),
    }
