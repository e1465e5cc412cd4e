"""The window policy against the core's conformance kit: with a window that covers every block it must
be exactly ``full`` in every scheduling situation, and every selection must obey the contract; with a
window of one sink and two recent blocks, each layer's output must be attention over exactly the blocks
it selected."""

import pytest
from nanovllm.conformance import cases, run_case
from nanovllm.plugins import get_plugins


@pytest.mark.parametrize("case", cases(), ids=str)
def test_conformance(case):
    if "window" not in get_plugins().registry.sparse_policies:
        pytest.skip("the entry point is registered only once the distribution is installed")
    run_case(case, "window:sink_blocks=64,recent_blocks=64", small_budget="window:sink_blocks=1,recent_blocks=2")
