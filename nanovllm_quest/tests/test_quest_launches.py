"""How many device kernels one decode ``select_blocks`` call launches on the Triton path, per mode. Each
launch has a cost of its own even in a CUDA graph, which at batch 1 is most of a small kernel's time, so a
regression in the count shows here, on the CPU. The Triton launches are counted, not run (their outputs
stay unwritten, and nothing reads them back to the host), and the torch ops between them by a dispatch
mode, leaving out views and allocations, which launch nothing. ``python test_quest_launches.py`` prints
the counts of every mode."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("triton")

from nanovllm.attention.metadata import PhaseMetadata  # noqa: E402
from nanovllm.attention.torch_backend import TorchBackend  # noqa: E402
from nanovllm.kv import PagedLayerKV  # noqa: E402
from nanovllm.sparse import PolicyContext  # noqa: E402
from nanovllm.testing import counting_torch_ops  # noqa: E402
from nanovllm_quest import kernels  # noqa: E402
from nanovllm_quest.config import QuestConfig  # noqa: E402
from nanovllm_quest.policy import QuestPolicy  # noqa: E402


class CopyingStore(PagedLayerKV):
    """The host pool's way of reading: it asks for the marked blocks (``read_paged`` calls the marks), and
    here reads the cache in place, so that only the policy's own ops are counted."""

    def read_paged(self, ctx, blocks, values=True, width=None):
        blocks()
        return self.k_cache, self.v_cache if values else None, ctx.meta.block_tables


def decode_context(num_seqs: int = 2, heads: int = 8, kv_heads: int = 2, dim: int = 16, block: int = 16,
                   width: int = 64, **config) -> tuple[QuestPolicy, PolicyContext]:
    """A Quest policy on the Triton kernels and one decode step whose block tables are wider than its
    budget (so that the layer is sparse), on CPU tensors."""
    policy = QuestPolicy(QuestConfig(skip_layers=0, token_budget=8 * block, **config))
    policy.initialize(1, kv_heads, dim, num_seqs * width, block, torch.bfloat16, torch.device("cpu"))
    policy.ops = kernels
    cache = torch.zeros(num_seqs * width, block, kv_heads, dim, dtype=torch.bfloat16)
    tables = torch.arange(num_seqs * width, dtype=torch.int32).view(num_seqs, width)
    lens = torch.full((num_seqs,), width * block - 3, dtype=torch.int32)
    meta = PhaseMetadata(torch.arange(num_seqs + 1, dtype=torch.int32), lens, tables, 1, int(lens.max()))
    q = torch.zeros(num_seqs, heads, dim, dtype=torch.bfloat16)
    return policy, PolicyContext(0, False, q, meta, cache, torch.zeros_like(cache), dim**-0.5, TorchBackend())


def select_launches(monkeypatch, store: type[PagedLayerKV] = PagedLayerKV, **config
                    ) -> tuple[Counter, Counter]:
    """``(triton kernels, torch ops)`` of one ``select_blocks`` call with ``config``, each by name."""
    policy, ctx = decode_context(**config)
    ctx.kv = store(ctx.layer_id, ctx.k_cache, ctx.v_cache)
    launched = Counter()

    def run(self, *args, grid, warmup, **kwargs):
        launched[self.fn.__name__] += 1

    monkeypatch.setattr(type(kernels._topk_kernel), "run", run)
    with counting_torch_ops() as ops:
        policy.select_blocks(ctx)
    return launched, Counter(ops)


# Triton launches of one select_blocks call per (group_reduction, rescore), and no torch op between them:
# scoring and top-K (with mass, the shares and their top-K in one launch); with rescore, the nominees' keys
# rescored, then the pick (with mass, the shares and the pick in one launch)
LAUNCHES = {("max", 1): 2, ("mass", 1): 2, ("max", 2): 4, ("mass", 2): 4}


def launch_table(monkeypatch) -> list[tuple[str, int, str, int, int]]:
    """``(group_reduction, rescore, store, Triton launches, torch ops)`` of each mode on both stores."""
    rows = []
    for reduction, rescore in LAUNCHES:
        for store in (PagedLayerKV, CopyingStore)[: rescore]:  # rescore=1 reads no keys: the stores agree
            launched, ops = select_launches(monkeypatch, store, group_reduction=reduction, rescore=rescore)
            name = "device-cache" if store is PagedLayerKV else "offload"
            rows.append((reduction, rescore, name, sum(launched.values()), sum(ops.values())))
    return rows


@pytest.mark.parametrize(("reduction", "rescore"), LAUNCHES)
def test_select_blocks_launches_quests_kernels_alone(monkeypatch, reduction, rescore):
    launched, ops = select_launches(monkeypatch, group_reduction=reduction, rescore=rescore)
    assert sum(launched.values()) == LAUNCHES[reduction, rescore] and not ops, (launched, ops)


@pytest.mark.parametrize("reduction", ["max", "mass"])
def test_offload_marks_the_nominees_without_nominating_again(monkeypatch, reduction):
    """The marks of the blocks to read from the host pool come from the nominees already selected."""
    launched, ops = select_launches(monkeypatch, CopyingStore, group_reduction=reduction, rescore=2)
    assert sum(launched.values()) == LAUNCHES[reduction, 2], launched
    assert sum(ops.values()) <= 4, ops  # the marks: zeros, the ids cast and shifted past the spare, a scatter


if __name__ == "__main__":
    with pytest.MonkeyPatch.context() as patch:
        print("group_reduction rescore store triton_launches torch_ops")
        for row in launch_table(patch):
            print(*row)
