from __future__ import annotations

import pytest
import torch

from davit_engine.kernels.layer_ops import silu_mul, silu_mul_reference
from davit_engine.kernels.pdl import PDL_ENV, pdl_enabled, pdl_launch, refresh


def test_no_pdl_off_the_gpu() -> None:
    assert pdl_launch(torch.device("cpu")) == {"USE_GDC": False}
    assert not pdl_enabled(torch.device("cpu"))


def test_pdl_follows_the_device_and_the_switch(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    """On an sm_90+ GPU the short kernels launch with PDL unless DAVIT_PDL=0; elsewhere (the
    CPU under Triton's interpreter, older GPUs) never. A kernel gives the same values either
    way."""
    monkeypatch.delenv(PDL_ENV, raising=False)
    refresh()
    on_hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    expected = {"USE_GDC": True, "launch_pdl": True} if on_hopper else {"USE_GDC": False}
    assert pdl_launch(device) == expected
    x = torch.randn(3, 2 * 96, device=device)
    with_default = silu_mul(x)
    monkeypatch.setenv(PDL_ENV, "0")
    refresh()
    assert pdl_launch(device) == {"USE_GDC": False}
    assert torch.equal(silu_mul(x), with_default)
    torch.testing.assert_close(with_default, silu_mul_reference(x))
    monkeypatch.delenv(PDL_ENV)
    refresh()
