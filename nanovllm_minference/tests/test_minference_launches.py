"""What one MInference prefill chunk costs the host on the Triton path, per layer: its device launches, the
torch ops between them and its host syncs. On a small model each launch and each wait on the GPU costs
more than the work it does, so a regression in the counts shows here, on the CPU. The Triton launches are
counted, not run (their outputs stay unwritten), and the torch ops by a dispatch mode that leaves out views
and allocations, which launch nothing; a sync is a read of a device value by the host
(``_local_scalar_dense``, ``nonzero``). ``python test_minference_launches.py`` prints the counts."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("triton")

import nanovllm_minference.attention as attention_module  # noqa: E402
import nanovllm_minference.policy as policy_module  # noqa: E402
from nanovllm.kv import PagedLayerKV  # noqa: E402
from nanovllm.testing import counting_torch_ops, prefill_context  # noqa: E402
from nanovllm_minference import estimate  # noqa: E402
from nanovllm_minference.config import MInferenceConfig  # noqa: E402
from nanovllm_minference.policy import MInferencePolicy  # noqa: E402

SYNCS = {"_local_scalar_dense", "nonzero", "item"}


class CopyingStore(PagedLayerKV):
    """The host pool's way of reading: it asks for the marked blocks (``read_paged`` calls the marks), and
    here reads the cache in place, so that only the policy's own ops are counted."""

    def read_paged(self, ctx, blocks, values=True, width=None):
        if callable(blocks):
            blocks()
        return self.k_cache, self.v_cache if values else None, ctx.meta.block_tables


def chunk_launches(monkeypatch, store: type[PagedLayerKV] = PagedLayerKV, **config
                   ) -> tuple[Counter, Counter]:
    """``(triton kernels, torch ops)`` of a ``compute_chunked_prefill`` call (a chunk of 256 rows after a
    history of 768, Gemma 3's 4 query heads on 1 KV head), each by name, on the Triton path: the second
    call, as every chunk after the layer's first."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1024, heads, 32, generator=g) for heads in (4, 1, 1))
    rows, ctx = prefill_context(q, k, v, 256, 32**-0.5)
    ctx.kv = store(ctx.layer_id, ctx.k_cache, ctx.v_cache)
    policy = MInferencePolicy(MInferenceConfig(dense_below=0, vertical_size=64, slash_size=128, **config))
    launched = Counter()

    def run(self, *args, grid, warmup, **kwargs):
        launched[self.fn.__name__] += 1

    def outputs(kernel, name, q, cu_seqlens_q, inputs, inputs_name):  # the CPU check of the kernel's wrapper
        return torch.empty_like(q), torch.empty(q.shape[:2]), True

    monkeypatch.setattr(type(estimate._row_stats_kernel), "run", run)
    monkeypatch.setattr(attention_module, "prefill_kernel_outputs", outputs)
    gpu_ops = policy_module._ops(torch.device("cuda"))  # the Triton path, on CPU tensors
    monkeypatch.setattr(policy_module, "_ops", lambda device: gpu_ops)
    with counting_torch_ops():
        policy.compute_chunked_prefill(rows, ctx.new_keys, ctx.new_values, ctx)
    launched.clear()
    with counting_torch_ops() as ops:
        policy.compute_chunked_prefill(rows, ctx.new_keys, ctx.new_values, ctx)
    return launched, Counter(ops)


# a vertical-slash chunk on the GPU cache: the estimate's two passes, the selection (ranking, top lines and
# index), the density, the columns' keys staged and the sparse kernel that reads them; one fill (the density's
# totals), no sync
DEVICE_CACHE = {"_row_stats_kernel": 1, "_sums_kernel": 1, "_select_kernel": 1, "_density_kernel": 1,
                "_stage_columns_kernel": 1, "_sparse_prefill_kernel": 1}
# slash_unit="tile" (the default): the selection keeps the columns alone, the bands are scored and chosen by
# torch ops, and the lines kernel makes the index
TILE_OPS = 64


@pytest.mark.parametrize("config", [{}, {"adaptive_budget": 0.2}, {"dense_above": None},
                                    {"slash_unit": "diagonal"}, {"slash_unit": "diagonal", "dense_above": None}])
def test_a_chunk_on_the_device_cache_launches_a_few_kernels_and_never_syncs(monkeypatch, config):
    launched, ops = chunk_launches(monkeypatch, **config)
    want = dict(DEVICE_CACHE)
    density = config.get("dense_above", 0.8) is not None
    if not density:  # no density to check
        del want["_density_kernel"]
    tile = config.get("slash_unit", "tile") == "tile"
    if tile:
        want["_lines_kernel"] = 1
    assert launched == want, launched
    assert not SYNCS & set(ops), ops
    assert sum(ops.values()) <= (TILE_OPS if tile else 0) + density, ops


def test_a_chunk_on_a_copying_store_syncs_once_before_reading_values(monkeypatch):
    """With KV offload the density is read back once, to read no value of a chunk that runs dense."""
    launched, ops = chunk_launches(monkeypatch, CopyingStore)
    assert launched["_sparse_prefill_kernel"] == 1 and launched["_select_kernel"] == 1, launched
    assert sum(ops[name] for name in SYNCS) == 1, ops


if __name__ == "__main__":
    with pytest.MonkeyPatch.context() as patch:
        for store in (PagedLayerKV, CopyingStore):
            launched, ops = chunk_launches(patch, store)
            print(store.__name__, "triton:", dict(launched), "torch:", dict(ops))
