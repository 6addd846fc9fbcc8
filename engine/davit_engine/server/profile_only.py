"""`davit serve MODEL ... --profile-only`: build the engine core, print its memory profile, exit.

A whole-engine mode of `davit serve` (it builds the engine core in this process), so it lives
beside the serve entry point. No HTTP server starts. The profile goes to stdout (one JSON line)
and to `--profile-output`: by default `/dev/termination-log` when it exists and is writable, so
a Kubernetes Job's pod carries the profile in its termination message for the operator to read.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from davit_engine.config import EngineConfig
from davit_engine.types import ParamError

logger = logging.getLogger(__name__)

TERMINATION_LOG = Path("/dev/termination-log")
# Kubernetes keeps at most this many bytes of a termination message.
TERMINATION_MESSAGE_LIMIT = 4096


def default_output() -> Path | None:
    """The termination log when this process may write it, else None."""
    if TERMINATION_LOG.exists() and os.access(TERMINATION_LOG, os.W_OK):
        return TERMINATION_LOG
    return None


def profile_only(config: EngineConfig, output: Path | None) -> int:
    """Profile `config` and write the result; 0 on success, 1 when the engine cannot start."""
    from davit_engine.engine_core import EngineCore

    try:
        core = EngineCore(config)
    except ParamError as exc:
        logger.error("cannot profile %s: %s: %s", config.model, exc.param, exc.message)
        return 1
    try:
        profile = core.memory_profile
        if profile is None:
            logger.error("the %s runner produced no memory profile", core.model_info.runner)
            return 1
        text = profile.to_json()
    finally:
        core.shutdown()
    if len(text.encode()) > TERMINATION_MESSAGE_LIMIT:
        logger.warning(
            "the profile (%d bytes) is longer than a termination message keeps (%d)",
            len(text.encode()),
            TERMINATION_MESSAGE_LIMIT,
        )
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    if output is not None:
        output.write_text(text)
        logger.info("memory profile written to %s", output)
    return 0
