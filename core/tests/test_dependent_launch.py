"""Which launches chain to the kernel before them (``nanovllm.dependent_launch``): kernels over at most
``MAX_TOKENS`` rows on CUDA devices of compute capability 9.0 and later, unless ``NANOVLLM_PDL=0``; never
CPU tensors (the interpreter). The GPU tests of the kernels and of the decode graphs run chained."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nanovllm import dependent_launch  # noqa: E402


@pytest.fixture
def fresh(monkeypatch):
    dependent_launch._enabled.cache_clear()
    yield monkeypatch
    dependent_launch._enabled.cache_clear()


@pytest.mark.parametrize("capability,variable,chained", [
    ((9, 0), None, True), ((10, 0), None, True), ((8, 9), None, False), ((9, 0), "0", False),
    ((9, 0), "1", True),
])
def test_hopper_and_later_chain_unless_turned_off(fresh, capability, variable, chained):
    fresh.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    if variable is None:
        fresh.delenv(dependent_launch.VARIABLE, raising=False)
    else:
        fresh.setenv(dependent_launch.VARIABLE, variable)
    assert dependent_launch._enabled(0) is chained


def test_cpu_tensors_never_chain(fresh):
    fresh.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert dependent_launch.launch_options(torch.zeros(1)) == {}


@pytest.mark.gpu
def test_gpu_small_steps_chain_and_large_ones_do_not():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("dependent launches need compute capability 9.0")
    small = torch.zeros(dependent_launch.MAX_TOKENS, 8, device="cuda")
    large = torch.zeros(dependent_launch.MAX_TOKENS + 1, 8, device="cuda")
    assert dependent_launch.launch_options(small) == {"PDL": True, "launch_pdl": True}
    assert dependent_launch.launch_options(large) == {}
