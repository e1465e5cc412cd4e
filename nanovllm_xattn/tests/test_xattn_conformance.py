"""XAttention against the core's conformance kit. At ``threshold=1`` every causal block is kept and
``dense_below=0`` keeps every chunk sparse, so every layer estimates, selects and attends through the
block-sparse kernel (or its reference), and must still be exactly ``full``; with offload through the
keys-only read and the kept-block read. The kit's small-budget check keeps a tenth of the key blocks
besides the sink and the diagonal: the output must differ from dense attention and stay a weighted average
of each sequence's values."""

import pytest
from nanovllm.conformance import cases, run_case
from nanovllm.plugins import get_plugins

SELECTION = "xattn:threshold=1.0,block_size=64,dense_below=0"
SMALL_BUDGET = "xattn:ratio=0.1,block_size=64,dense_below=0,keep_recent=false"


@pytest.mark.parametrize("case", cases(), ids=str)
def test_conformance(case):
    if "xattn" not in get_plugins().registry.sparse_policies:
        pytest.skip("the entry point is registered only once the distribution is installed")
    run_case(case, SELECTION, small_budget=SMALL_BUDGET)
