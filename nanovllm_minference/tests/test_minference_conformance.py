"""MInference against the core's conformance kit. Budgets of 512 lines cover every sequence of the kit's
scenarios (max_model_len 512), and ``dense_below=0`` with ``dense_above=null`` keeps every chunk sparse, so
every layer estimates, builds an index and attends through the sparse kernel (or its reference), and must
still be exactly ``full``; with offload through the keys-only read and the touched-block read."""

import pytest
from nanovllm.conformance import cases, run_case
from nanovllm.plugins import get_plugins

SELECTION = "minference:vertical_size=512,slash_size=512,dense_below=0,dense_above=null"


@pytest.mark.parametrize("case", cases(), ids=str)
def test_conformance(case):
    if "minference" not in get_plugins().registry.sparse_policies:
        pytest.skip("the entry point is registered only once the distribution is installed")
    run_case(case, SELECTION)
