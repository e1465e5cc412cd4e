"""The host's launch-size helpers give Triton's results, and the kernel wrappers use them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nanovllm.kernel_sizes import cdiv, next_power_of_2

ROOT = Path(__file__).resolve().parents[2]


def test_the_helpers_give_tritons_results():
    triton = pytest.importorskip("triton")
    for n in range(-3, 70000, 7):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 128):
            if n >= 0:
                assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_no_launch_sizes_through_tritons_host_wrappers():
    """``triton.cdiv`` and ``triton.next_power_of_2`` cost microseconds a call on the host; every package's
    launch wrappers size with the helpers instead."""
    sources = [path for pattern in ("core/src/**/*.py", "nanovllm_*/src/**/*.py", "plugins/*/src/**/*.py")
               for path in ROOT.glob(pattern)]
    calls = [f"{path.relative_to(ROOT)}:{number}" for path in sources
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\btriton\.(cdiv|next_power_of_2)\(", line)]
    assert not calls, calls
