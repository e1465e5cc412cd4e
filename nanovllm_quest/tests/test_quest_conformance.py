"""Quest against the core's conformance kit. The budget (100 blocks of 4 tokens) covers every sequence of
the kit's scenarios but not the block table (128 blocks at max_model_len 512), so every layer scores,
selects and attends through its per-KV-head selection, and must still be exactly ``full``: with pages of
one block (whose metadata the kit also recomputes block by block), with pages of 4 blocks, with float8
bounds (rounded outward in every update, so the kept metadata equals the recomputed one), with float8
bounds over halves of a page, and with the bound's nominees rescored by their keys (read through the KV
store: in place on the GPU cache, only the nominees' keys from the host pool with offload). The kit's small-budget
check runs the same options at a budget of 4 pages, one of them recent (every layer scores and ranks), and
compares each decode with attention over exactly the pages selected."""

import pytest
from nanovllm.conformance import Case, cases, run_case
from nanovllm.plugins import get_plugins

SELECTION = "quest:token_budget=400,skip_layers=0"
SMALL_BUDGET = "quest:token_budget={},recent_pages=1,skip_layers=0"


@pytest.mark.parametrize("options", ["page_size=4", "page_size=16", "page_size=4,metadata_dtype=fp8",
                                     "bound_size=2,metadata_dtype=fp8", "page_size=4,rescore=3"])
@pytest.mark.parametrize("case", cases(), ids=str)
def test_conformance(case, options):
    if "quest" not in get_plugins().registry.sparse_policies:
        pytest.skip("the entry point is registered only once the distribution is installed")
    page = 16 if "page_size=16" in options else 4
    run_case(case, f"{SELECTION},{options}", small_budget=f"{SMALL_BUDGET.format(4 * page)},{options}")


# The decode graphs on the hybrid model under KV offload, with Quest's rescoring (compact copies of the
# nominees' keys from the host pool) and its split bounds (several bounds a page, reset on reallocation)
# each on its own: which of the two the graphs of the page_size=4 options above depend on.
@pytest.mark.gpu
@pytest.mark.parametrize("options", ["rescore=1,metadata_dtype=kv", "rescore=2,metadata_dtype=kv",
                                     "rescore=1,metadata_dtype=fp8,bound_size=2",
                                     "rescore=1,metadata_dtype=fp8,bound_size=4"])
def test_decode_graphs_under_hybrid_offload(options):
    if "quest" not in get_plugins().registry.sparse_policies:
        pytest.skip("the entry point is registered only once the distribution is installed")
    case = Case("cuda_graphs", "cuda", "triton", offload=True, hybrid=True)
    run_case(case, f"{SELECTION},page_size=4,{options}")
