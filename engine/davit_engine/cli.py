"""`davit` console entry point: dispatches to the engine's and the operator's commands.

Each subcommand's module is imported only when it is picked, so `davit operator` never
imports torch and `davit serve` never imports kopf.
"""

from __future__ import annotations

import sys

USAGE = """usage: davit COMMAND [ARGS...]

engine commands:
  serve MODEL [flags]      serve MODEL over an OpenAI-compatible HTTP API
  bench throughput|serve   offline throughput / online serving benchmarks

operator commands:
  operator [flags]         run the InferenceService operator
  cluster up|down|status   the local control plane used by tests and the demo
  crds [--check]           write (or check) the generated CustomResourceDefinitions

Run `davit COMMAND --help` for a command's flags.
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "serve":
        from davit_engine.server.cli import serve_main

        return serve_main(rest)
    if command == "bench":
        from davit_engine.bench.cli import bench_main

        return bench_main(rest)
    if command in ("operator", "cluster", "crds"):
        from davit_operator.cli import operator_cli_main

        return operator_cli_main(command, rest)
    print(f"davit: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
