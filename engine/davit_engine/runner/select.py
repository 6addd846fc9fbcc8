"""Runner selection: which runner serves a configuration on a device, and why.

`auto` picks V2 on CUDA unless something needs V1; on the CPU only V1 exists. An explicit choice
that cannot work stops at startup with a ParamError naming the flag or the feature.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import torch

from davit_engine.config import EngineConfig
from davit_engine.loader import LoadedModel
from davit_engine.runner.base import ModelRunner
from davit_engine.runner.capability import v1_only_features
from davit_engine.types import ParamError

logger = logging.getLogger(__name__)


def resolve_device(config: EngineConfig) -> torch.device:
    """The engine core's device; under tensor parallelism rank 0's (rank r uses cuda:r)."""
    if config.tensor_parallel_size > 1:
        return _tensor_parallel_device(config)
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device not in ("cpu", "cuda") and not config.device.startswith("cuda:"):
        raise ParamError("--device", f"must be auto, cpu or cuda[:N], got {config.device!r}")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ParamError("--device", f"{config.device} was requested but no CUDA device is visible")
    return torch.device(config.device)


def _tensor_parallel_device(config: EngineConfig) -> torch.device:
    size = config.tensor_parallel_size
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if config.device not in ("auto", "cuda"):
        raise ParamError(
            "--device",
            f"must be auto, cpu or cuda with --tensor-parallel-size {size} (rank r runs on "
            f"cuda:r), got {config.device!r}",
        )
    if not torch.cuda.is_available():
        raise ParamError("--device", "cuda was requested but no CUDA device is visible")
    if torch.cuda.device_count() < size:
        raise ParamError(
            "--tensor-parallel-size",
            f"{size} ranks need {size} GPUs; {torch.cuda.device_count()} are visible",
        )
    return torch.device("cuda:0")


def _v2_available() -> bool:
    """Whether this build ships runner V2 (imported only on CUDA, where it can run)."""
    if importlib.util.find_spec("davit_engine.runner.v2") is None:
        return False
    try:
        module = importlib.import_module("davit_engine.runner.v2")
    except ImportError as exc:
        logger.warning("runner V2 cannot be imported: %s", exc)
        return False
    return hasattr(module, "RunnerV2")


def select_runner(config: EngineConfig, device: torch.device) -> tuple[str, str]:
    """(runner kind, human-readable reason) for `config.runner` on `device`."""
    v1_only = v1_only_features()
    if config.speculative_config is not None:
        _check_speculation(config, device, v1_only)
    if config.runner == "v1":
        return "v1", "requested with --runner v1"
    tp = config.tensor_parallel_size
    if tp > 1 and config.runner in ("v2", "auto"):
        if config.runner == "v2":
            raise ParamError(
                "--runner",
                f"runner V2 does not support --tensor-parallel-size {tp} yet: use --runner v1 "
                "or auto",
            )
        return "v1", f"--tensor-parallel-size {tp} runs on runner V1"
    if config.runner == "v2":
        if device.type != "cuda":
            raise ParamError(
                "--runner", f"runner V2 needs a CUDA device; this engine runs on {device.type}"
            )
        if v1_only:
            raise ParamError(
                "--runner",
                f"runner V2 does not support {'; '.join(v1_only)}: use --runner v1 or auto",
            )
        if not _v2_available():
            raise ParamError("--runner", "runner V2 is not included in this build; use --runner v1")
        return "v2", "requested with --runner v2"
    if config.runner != "auto":
        raise ParamError("--runner", f"must be auto, v1 or v2, got {config.runner!r}")
    if device.type != "cuda":
        return "v1", "runner V2 needs a CUDA device"
    if v1_only:
        return "v1", f"{'; '.join(v1_only)} need runner V1"
    if not _v2_available():
        return "v1", "runner V2 is not included in this build"
    return "v2", "CUDA device available"


def _check_speculation(config: EngineConfig, device: torch.device, v1_only: list[str]) -> None:
    """Speculative decoding runs on runner V2 only (its verification and draft passes keep
    request state on the device); refuse every setup that cannot give it V2."""
    flag = "--speculative-config"
    method = config.speculative_config.method if config.speculative_config else ""
    if config.runner == "v1":
        raise ParamError(
            flag,
            f"speculative decoding (method {method}) needs runner V2; runner V1 does not "
            "implement it: drop --runner v1 or the speculative configuration",
        )
    if device.type != "cuda":
        raise ParamError(
            flag,
            f"speculative decoding (method {method}) needs runner V2, which needs a CUDA "
            f"device; this engine runs on {device.type}",
        )
    if v1_only:
        raise ParamError(
            flag,
            f"speculative decoding needs runner V2, but {'; '.join(v1_only)} need runner V1: "
            "use one or the other",
        )


def create_runner(
    kind: str, config: EngineConfig, loaded: LoadedModel, device: torch.device
) -> ModelRunner:
    if kind == "v2":
        runner_class = importlib.import_module("davit_engine.runner.v2").RunnerV2
        runner: ModelRunner = runner_class(config, loaded, device)
        return runner
    from davit_engine.runner.v1 import RunnerV1

    return RunnerV1(config, loaded, device)
