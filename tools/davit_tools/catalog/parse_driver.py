"""Run inside a throwaway environment holding one vLLM release: parse command lines with that
release's own `vllm serve` command-line path and report what happened.

Usage: python parse_driver.py IN.json OUT.json, IN holding [{"name", "args", "env"}].
Stdlib and the installed release only (this file is copied out of the repository and run with
the environment's interpreter).

For each command line the release's CLI entry point (`vllm.entrypoints.cli.main.main`) runs with
`sys.argv = ["vllm", "serve", *args]`: it builds the same parser `vllm serve` builds, parses,
runs the serve subcommand's own validation, and calls the subcommand, which is replaced here by
a recorder that stops before any server or engine starts. The recorder then builds the
release's engine arguments from the parsed namespace (`AsyncEngineArgs.from_cli_args`), which
needs no model and no device, and runs the release's check of the process environment
(`validate_environ`, the first step of its engine-config construction) with the operator's
`VLLM_*` variables for the line. OUT gets, per name: `parsed` (bool), `error` (argparse's
message or the exception), the parsed value of each flag on the line (`values`),
`engine_args` and `environ` (ok or the error); an empty line gets `parsed: null`. A missing
module stops everything and is reported as {"missing_module": name}.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from typing import Any

MAX_ERROR = 600


class _Recorded(Exception):
    def __init__(self, namespace: Any) -> None:
        super().__init__("recorded")
        self.namespace = namespace


def _recorder(namespace: Any) -> None:
    raise _Recorded(namespace)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return f"{type(value).__name__}: {value}"


def _values(namespace: Any, args: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"model_tag": _plain(getattr(namespace, "model_tag", None))}
    for arg in args:
        if not arg.startswith("--"):
            continue
        name = arg[2:].split("=", 1)[0]
        dest = name.removeprefix("no-").replace("-", "_")
        if hasattr(namespace, dest):
            out[arg] = _plain(getattr(namespace, dest))
    return out


def _argparse_error(stderr: str, code: object) -> str:
    """argparse's `PROG: error: ...` message (it can span lines), whitespace collapsed."""
    start = stderr.find("error:")
    text = stderr[start:] if start >= 0 else stderr
    return " ".join(text.split())[:MAX_ERROR] or f"exit {code}"


def _environ(namespace: Any, env: dict[str, str], engine_args: Any) -> str:
    """The release's own check of the process environment (`validate_environ`, which its
    engine-config construction runs first) applied to the operator's variables for the line."""
    from vllm.platforms import current_platform

    validate = getattr(current_platform, "validate_environ", None)
    if validate is None:
        return "no environment validation in this release"
    hard_fail = bool(getattr(engine_args, "fail_on_environ_validation", False))
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if k.startswith("VLLM_")})
    try:
        validate(hard_fail)
    except Exception as failed:
        return f"{type(failed).__name__}: {failed}"[:MAX_ERROR]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return "ok"


def check(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    if not args:  # the operator emits no line for this release (its builder refuses the spec)
        return {"parsed": None, "error": None}
    from vllm.entrypoints.cli import main as cli_main
    from vllm.entrypoints.cli import serve

    serve.ServeSubcommand.cmd = staticmethod(_recorder)
    sys.argv = ["vllm", "serve", *args]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            cli_main.main()
    except _Recorded as recorded:
        namespace = recorded.namespace
    except SystemExit as stopped:
        return {"parsed": False, "error": _argparse_error(stderr.getvalue(), stopped.code)}
    except ModuleNotFoundError:
        raise
    except Exception as failed:  # the release's own validation refused the line
        return {"parsed": False, "error": f"{type(failed).__name__}: {failed}"[:MAX_ERROR]}
    else:
        return {"parsed": False, "error": "the serve subcommand was never dispatched"}
    result: dict[str, Any] = {"parsed": True, "error": None, "values": _values(namespace, args)}
    engine_args = None
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs

        engine_args = AsyncEngineArgs.from_cli_args(namespace)
        result["engine_args"] = "ok"
    except ModuleNotFoundError:
        raise
    except Exception as failed:
        result["engine_args"] = f"{type(failed).__name__}: {failed}"[:MAX_ERROR]
    result["environ"] = _environ(namespace, env, engine_args)
    return result


def probe() -> None:
    """Import everything `vllm` imports to build its parsers (`vllm --version` does, then exits),
    so that an incomplete environment is told apart from a refused command line."""
    from vllm.entrypoints.cli import main as cli_main

    sys.argv = ["vllm", "--version"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        cli_main.main()


def main() -> int:
    source, target = sys.argv[1], sys.argv[2]
    with open(source) as handle:
        lines = json.load(handle)
    results: dict[str, Any] = {}
    try:
        probe()
        for line in lines:
            results[line["name"]] = check(list(line["args"]), dict(line.get("env", {})))
    except ModuleNotFoundError as missing:
        results = {"missing_module": missing.name, "traceback": traceback.format_exc()[-3000:]}
    except Exception:
        results = {"environment_error": traceback.format_exc()[-3000:]}
    with open(target, "w") as handle:
        json.dump(results, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
