"""The `davit` command: dispatches to the engine's or the operator's commands.

Each half is a distribution of its own (`davit-engine`, `davit-operator`); this package holds
only the dispatcher, so an image carries the half it runs and nothing else. A command whose
half is not installed says which distribution provides it. Each subcommand's module is
imported only when it is picked: `davit operator` never imports torch, `davit serve` never
imports kopf.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

USAGE = """usage: davit COMMAND [ARGS...]

engine commands (davit-engine):
  serve MODEL [flags]      serve MODEL over an OpenAI-compatible HTTP API
  bench throughput|serve   offline throughput / online serving benchmarks

operator commands (davit-operator):
  operator [flags]         run the InferenceService operator
  crds [--check]           write (or check) the generated CustomResourceDefinitions
  fetch --source SRC ...   fetch a model revision into the model cache (what fetch Jobs run)

development commands (davit-tools, from a source checkout):
  cluster up|down|status|env   the local control plane used by tests and the demo

Run `davit COMMAND --help` for a command's flags.
"""


@dataclass(frozen=True)
class Command:
    """Where a command lives: `module:function` in the named distribution. The function takes
    the arguments after the command name and returns the exit status."""

    distribution: str
    package: str
    target: str


COMMANDS: dict[str, Command] = {
    "serve": Command("davit-engine", "davit_engine", "davit_engine.server.cli:serve_main"),
    "bench": Command("davit-engine", "davit_engine", "davit_engine.bench.cli:bench_main"),
    "operator": Command("davit-operator", "davit_operator", "davit_operator.cli:run_operator"),
    "crds": Command("davit-operator", "davit_operator", "davit_operator.api.crdgen:crdgen_main"),
    "fetch": Command("davit-operator", "davit_operator", "davit_operator.fetch.main:fetch_main"),
    "cluster": Command("davit-tools", "davit_tools", "davit_tools.devcluster.cli:devcluster_main"),
}


def _load(command: Command) -> Callable[[list[str]], int] | None:
    if importlib.util.find_spec(command.package) is None:
        return None
    module, _, attr = command.target.partition(":")
    function: Callable[[list[str]], int] = getattr(importlib.import_module(module), attr)
    return function


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    name, rest = args[0], args[1:]
    command = COMMANDS.get(name)
    if command is None:
        print(f"davit: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    function = _load(command)
    if function is None:
        print(
            f"davit: {name!r} is provided by the {command.distribution} distribution, which is "
            f"not installed here (no {command.package} package)",
            file=sys.stderr,
        )
        return 2
    return function(rest)
