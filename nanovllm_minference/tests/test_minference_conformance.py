"""MInference against the core's conformance kit. Budgets of 512 lines cover every sequence of the kit's
scenarios (max_model_len 512), and ``dense_below=0`` with ``dense_above=null`` keeps every chunk sparse, so
every layer estimates, builds an index and attends through the sparse kernel (or its reference), and must
still be exactly ``full``; with offload through the keys-only read and the touched-block read. The kit's
small-budget check keeps 8 vertical and 8 slash lines besides 2 sink tokens and 4 recent diagonals: the
output must differ from dense attention and stay a weighted average of each sequence's values."""

import pytest
from nanovllm.conformance import cases, run_case
from nanovllm.plugins import get_plugins

SELECTION = "minference:vertical_size=512,slash_size=512,dense_below=0,dense_above=null"
SMALL_BUDGET = ("minference:vertical_size=8,slash_size=8,num_sink_tokens=2,num_recent_diags=4,dense_below=0,"
                "dense_above=null")


@pytest.mark.parametrize("case", cases(), ids=str)
def test_conformance(case):
    if "minference" not in get_plugins().registry.sparse_policies:
        pytest.skip("the entry point is registered only once the distribution is installed")
    run_case(case, SELECTION, small_budget=SMALL_BUDGET)
