"""The CUDA caching allocator's configuration for serving.

A serving step's temporary tensors change size with the batch (the sampler's logits grow by one
row per running request, prefill chunks vary by token). With the default allocator every new
size that does not fit a cached block reserves a new segment, and the cached ones stay: on an
H200 at 256 sequences, reserved memory rose 2.3 GiB above the steady state while live tensors
never exceeded 0.24 GiB, which the KV cache sized from the profile could not absorb. Expandable
segments grow and shrink one mapping instead, so reserved memory follows live memory and the
profiled activation peak holds for the whole run.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
SERVING_ALLOC_CONF = "expandable_segments:True"


def configure_cuda_allocator() -> str:
    """Turn on expandable segments unless the operator of the process chose a configuration.

    Returns the configuration in effect (the environment's own when it is set). Must run
    before the first CUDA allocation to take effect through the environment; after that the
    setting is applied to the live allocator.
    """
    chosen = os.environ.get(ALLOC_CONF_ENV)
    if chosen is not None:
        return chosen
    os.environ[ALLOC_CONF_ENV] = SERVING_ALLOC_CONF
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
        if setter is not None:
            setter(SERVING_ALLOC_CONF)
        else:
            logger.warning("CUDA already initialised: %s not applied", SERVING_ALLOC_CONF)
    return SERVING_ALLOC_CONF
