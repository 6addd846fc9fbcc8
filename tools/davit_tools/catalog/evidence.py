"""`python -m davit_tools.catalog.evidence VERSION... [--wheel-dir DIR] [--out DIR]`

For each vLLM release: open its wheel (downloaded without dependencies into the wheel cache
when missing), read the facts (`runners`, `features`, `flags`, `passconfig`, `build`), plan the
operator's command lines for that release (`command_lines`), run the contract check
(`parser_check`, unless `--no-parser-check`), and write `vllm-VERSION.json` (sorted keys) into
the evidence folder. A version the index has no wheel for gets a file saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from davit_tools.catalog import sections
from davit_tools.catalog.command_lines import CommandLine, emitted_flags, operator_command_lines
from davit_tools.catalog.contract import contract_section
from davit_tools.catalog.parser_check import (
    DEFAULT_WORK_DIR,
    CheckError,
    ParserCheck,
    check_release,
)
from davit_tools.catalog.schema import SCHEMA_VERSION, Evidence
from davit_tools.catalog.summary import summarize
from davit_tools.catalog.wheel import (
    DEFAULT_WHEEL_DIR,
    ReleaseNotPublished,
    ReleaseWheel,
    open_release,
)

EVIDENCE_DIR = Path(__file__).with_name("evidence")
TOOL = "davit_tools.catalog.evidence"


def release_evidence(
    wheel: ReleaseWheel, lines: list[CommandLine], check: ParserCheck | None
) -> Evidence:
    """The evidence of one published release (`check` None: contract check not run)."""
    lists = sections.feature_lists(wheel)
    guards = sections.guards(wheel)
    selection = sections.selection(wheel)
    document: dict[str, object] = {
        "schemaVersion": SCHEMA_VERSION,
        "engine": "vllm",
        "version": wheel.version,
        "published": True,
        "tool": TOOL,
        "artifact": sections.artifact(wheel),
        "runners": sections.runner_classes(wheel),
        "switch": sections.switch(wheel),
        "selection": selection,
        "featureLists": lists,
        "guards": guards,
        "runnerReads": sections.runner_reads(wheel),
        "platformPredicates": sections.platform_predicates(wheel, lists),
        "summary": summarize(selection, lists, guards),
        "flags": sections.flag_lookup(wheel, emitted_flags(lines)),
        "speculativeMethods": sections.speculative_methods(wheel),
        "precision": sections.precision(wheel),
        "passConfig": sections.pass_config(wheel),
        "build": sections.build_facts(wheel),
        "contract": contract_section(wheel, lines, check),
    }
    return Evidence.model_validate(document)


def unpublished(version: str) -> Evidence:
    """The evidence of a version the index has no wheel for."""
    return Evidence.model_validate(
        {
            "schemaVersion": SCHEMA_VERSION,
            "engine": "vllm",
            "version": version,
            "published": False,
            "tool": TOOL,
            "artifact": None,
            "runners": None,
            "switch": None,
            "selection": None,
            "featureLists": [],
            "guards": [],
            "runnerReads": None,
            "platformPredicates": [],
            "summary": None,
            "flags": None,
            "speculativeMethods": None,
            "precision": None,
            "passConfig": None,
            "build": None,
            "contract": None,
        }
    )


# Sections `--update` recomputes from the wheel alone (no command lines, no contract check).
UPDATABLE = {
    "precision": sections.precision,
    "speculativeMethods": sections.speculative_methods,
}


def updated(wheel: ReleaseWheel, out_dir: Path, names: list[str]) -> Evidence:
    """The release's committed evidence with the sections `names` read again from its wheel
    (a section added to the tool since the file was written; the others stay as they are)."""
    path = out_dir / f"vllm-{wheel.version}.json"
    document = json.loads(path.read_text())
    if document.get("artifact", {}).get("sha256") != wheel.sha256:
        raise SystemExit(f"{path}: written from another wheel than {wheel.filename}")
    for name in names:
        document[name] = UPDATABLE[name](wheel)
    return Evidence.model_validate(document)


def write(evidence: Evidence, out_dir: Path) -> Path:
    """Write `evidence` as `out_dir/vllm-VERSION.json`: sorted keys, one-space indent."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"vllm-{evidence.version}.json"
    data = evidence.model_dump(mode="json", by_alias=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m davit_tools.catalog.evidence")
    parser.add_argument("versions", nargs="+", metavar="VERSION")
    parser.add_argument("--wheel-dir", type=Path, default=DEFAULT_WHEEL_DIR)
    parser.add_argument("--out", type=Path, default=EVIDENCE_DIR)
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    parser.add_argument(
        "--no-parser-check",
        action="store_true",
        help="skip the contract check (no environment is built; lines get parsed: null)",
    )
    parser.add_argument(
        "--update",
        action="append",
        choices=sorted(UPDATABLE),
        metavar="SECTION",
        help="recompute only this section of the committed file from the wheel (repeatable; "
        f"{', '.join(sorted(UPDATABLE))}); the other sections stay as written",
    )
    args = parser.parse_args(argv)
    if args.update:
        for version in args.versions:
            wheel = open_release(args.wheel_dir, version)
            path = write(updated(wheel, args.out, args.update), args.out)
            print(f"{version}: updated {', '.join(args.update)} in {path}", flush=True)
        return 0
    failed: list[str] = []
    for version in args.versions:
        lines = operator_command_lines(version)
        try:
            wheel = open_release(args.wheel_dir, version)
        except ReleaseNotPublished as missing:
            print(f"{version}: {missing}", flush=True)
            write(unpublished(version), args.out)
            continue
        print(f"{version}: {wheel.filename}", flush=True)
        try:
            check = None if args.no_parser_check else check_release(wheel, lines, args.work_dir)
        except CheckError as error:
            # The file keeps its previous content; the other releases still run.
            print(f"{version}: contract check failed, nothing written: {error}", flush=True)
            failed.append(version)
            continue
        path = write(release_evidence(wheel, lines, check), args.out)
        print(f"{version}: wrote {path}", flush=True)
    if failed:
        print(f"not written: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
