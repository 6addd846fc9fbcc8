"""`davit bench SUBCOMMAND`: dispatch to the benchmark, importing only the one picked."""

from __future__ import annotations

import sys

USAGE = """usage: davit bench {throughput,serve} [flags]

  throughput   offline: random prompts through the engine in this process
  serve        online: HTTP load against a running `davit serve`

Run `davit bench SUBCOMMAND --help` for its flags.
"""


def bench_main(rest: list[str]) -> int:
    if not rest or rest[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, args = rest[0], rest[1:]
    if command == "throughput":
        from davit_engine.bench.throughput import throughput_main

        return throughput_main(args)
    if command == "serve":
        from davit_engine.bench.serve import serve_bench_main

        return serve_bench_main(args)
    print(f"davit bench: unknown benchmark {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
