"""The evidence file's contract section: the operator's command lines against one release.

`static_check` looks each line up in the release's source; `contract_section` adds what the
release's own CLI made of it (`parser_check`) and states the method and its limits.
"""

from __future__ import annotations

import json

from davit_tools.catalog import flags
from davit_tools.catalog.command_lines import CommandLine
from davit_tools.catalog.parser_check import ParserCheck
from davit_tools.catalog.wheel import ReleaseWheel

METHOD = (
    "A throwaway virtual environment (outside the repository) with the release's wheel installed "
    "--no-deps and then only the distributions importing its CLI reports missing, each at the "
    "version the release's METADATA pins (torch: the pinned CUDA build with the CUDA libraries it "
    "needs to import); each line run through the release's `vllm serve` entry point "
    "(vllm.entrypoints.cli.main.main with argv `vllm serve ARGS`: the release's own parser and "
    "serve validation), the serve subcommand replaced by a recorder, then "
    "AsyncEngineArgs.from_cli_args on the parsed namespace and the release's validate_environ "
    "with the line's VLLM_* variables."
)
LIMITS = (
    "No GPU and no model: the release's engine config (runner choice, model- and "
    "device-dependent checks) is not built. `parsed` covers the parser and the serve "
    "subcommand's validation; `engineArgs` the construction of the release's engine arguments; "
    "`environ` the release's check of the operator's VLLM_* variables. The platform is the "
    "release's CPU platform (VLLM_TARGET_DEVICE=cpu), which only changes device defaults."
)
NOT_CHECKED = "Not run for this release (the tool was run with --no-parser-check)."


def static_check(wheel: ReleaseWheel, line: CommandLine, known: set[str]) -> dict[str, object]:
    """The line's flags the release's source lacks, and keys of its JSON-valued flags the config
    class the release validates them into lacks."""
    unknown_keys: list[str] = []
    for index, arg in enumerate(line.args[:-1]):
        if arg.startswith("--") and line.args[index + 1].startswith("{"):
            value = json.loads(line.args[index + 1])
            unknown_keys += [
                f"{arg} {check.path} ({check.config_class})"
                for check in flags.json_keys(wheel, arg, value)
                if check.source is None
            ]
    return {
        "unknownFlags": [a for a in line.args if a.startswith("--") and a not in known],
        "unknownJsonKeys": unknown_keys,
    }


def contract_section(
    wheel: ReleaseWheel, lines: list[CommandLine], check: ParserCheck | None
) -> dict[str, object]:
    """The contract section: how the check was made and each line's static and parsed result
    (`check` None: not run, every line `parsed: null`)."""
    known = set(flags.release_flags(wheel))
    results = check.results if check else {}
    return {
        "checked": check is not None,
        "method": METHOD if check else NOT_CHECKED,
        "limits": LIMITS,
        "python": check.python if check else None,
        "installSteps": check.install_steps if check else [],
        "installed": check.installed if check else [],
        "commandLines": [
            {
                "name": line.name,
                "origin": line.origin,
                "command": line.command,
                "args": line.args,
                "env": line.env,
                "planner": line.planner,
                "staticCheck": static_check(wheel, line, known),
                "parsed": results[line.name]["parsed"] if check else None,
                "error": results[line.name]["error"] if check else None,
                "values": results[line.name].get("values", {}) if check else {},
                "engineArgs": results[line.name].get("engine_args") if check else None,
                "environ": results[line.name].get("environ") if check else None,
            }
            for line in lines
        ],
        "verified": check is not None,
    }
