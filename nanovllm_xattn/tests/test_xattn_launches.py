"""What one sparse prefill chunk-layer (``compute_chunked_prefill``) costs the host on the Triton path: its
kernel launches, the torch ops between them, and its host syncs. Each launch costs host time of its own, and
a host sync stalls the queue of launches behind it, so at a small model's shape they, not the GPU's work, set
the chunk's time; a regression in the counts shows here, on the CPU.

The call runs on ``meta`` tensors, which hold no data: any read back to the host (``.item()``, ``.tolist()``,
``nonzero``, a boolean-mask index, ``.cpu()``, sizing a tensor by a computed maximum) raises, so a call that
completes made no host sync. The Triton launches are counted, not run, and the torch ops by a dispatch mode,
leaving out views and bare allocations, which launch nothing. ``python test_xattn_launches.py`` prints the
counts of each mode."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("triton")

from nanovllm.attention import backend as core_backend  # noqa: E402
from nanovllm.attention.metadata import PhaseMetadata  # noqa: E402
from nanovllm.attention.torch_backend import TorchBackend  # noqa: E402
from nanovllm.sparse import PolicyContext  # noqa: E402
from nanovllm.testing import counting_torch_ops  # noqa: E402
from nanovllm_xattn import attention, estimate, selection  # noqa: E402
from nanovllm_xattn import policy as policy_module  # noqa: E402
from nanovllm_xattn.config import XAttentionConfig  # noqa: E402
from nanovllm_xattn.policy import XAttentionPolicy  # noqa: E402


# Triton launches of one chunk-layer: the estimate's two passes, the selection's mask and lists, the attention
# (and the merge of its splits, when it splits the lists: kv_splits)
LAUNCHES = 5


class InterpretedFunction:
    """Stands for the attention kernel in ``prefill_kernel_outputs``' check, which lets only CUDA tensors or
    the interpreter's kernels through: here the launch is counted, not run."""


def chunk_context(num_heads: int = 4, num_kv_heads: int = 1, head_dim: int = 256, history: int = 24576,
                  chunk: int = 8192, kv_block: int = 16, **config) -> tuple[XAttentionPolicy, PolicyContext]:
    """The policy and one prefill chunk after ``history`` tokens, one sequence, on meta tensors (Gemma 3
    270M's full-attention shape by default)."""
    policy = XAttentionPolicy(XAttentionConfig(**{"dense_below": 0, **config}))
    context = history + chunk
    width = -(-context // kv_block)
    meta_device = torch.device("meta")
    policy.initialize(1, num_kv_heads, head_dim, width, kv_block, torch.bfloat16, meta_device)
    cache = torch.empty(width, kv_block, num_kv_heads, head_dim, dtype=torch.bfloat16, device=meta_device)
    cu = torch.empty(2, dtype=torch.int32, device=meta_device)
    lens = torch.empty(1, dtype=torch.int32, device=meta_device)
    tables = torch.empty(1, width, dtype=torch.int32, device=meta_device)
    q = torch.empty(chunk, num_heads, head_dim, dtype=torch.bfloat16, device=meta_device)
    new_kv = torch.empty(chunk, num_kv_heads, head_dim, dtype=torch.bfloat16, device=meta_device)
    return policy, PolicyContext(0, True, q, PhaseMetadata(cu, lens, tables, chunk, context), cache, cache,
                                 head_dim**-0.5, TorchBackend(), None, new_kv, new_kv)


def chunk_launches(monkeypatch, splits: int = 1, **config) -> tuple[Counter, Counter]:
    """``(triton kernels, torch ops)`` of one sparse ``compute_chunked_prefill`` on the Triton path, the
    attention's lists in ``splits``, each by name, after a first call (per-layer state made once, such as the
    thresholds, is not counted)."""
    from triton.runtime.jit import JITFunction

    launched = Counter()

    def run(self, *args, grid, warmup, **kwargs):
        launched[self.fn.__name__] += 1

    def outputs(kernel, *args):
        return prefill_kernel_outputs(InterpretedFunction(), *args)

    prefill_kernel_outputs = core_backend.prefill_kernel_outputs
    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setattr(policy_module, "_ops", lambda device: (estimate.block_scores,
                                                               attention.block_sparse_attention))
    monkeypatch.setattr(estimate, "is_interpreted", lambda: True)
    monkeypatch.setattr(attention, "prefill_kernel_outputs", outputs)
    monkeypatch.setattr(selection, "_on_triton", lambda t: True)
    monkeypatch.setattr(attention, "kv_splits", lambda num_programs, device: splits)
    policy, ctx = chunk_context(**config)
    policy.compute_chunked_prefill(ctx.query, ctx.new_keys, ctx.new_values, ctx)
    launched.clear()
    with counting_torch_ops() as ops:
        out = policy.compute_chunked_prefill(ctx.query, ctx.new_keys, ctx.new_values, ctx)
    assert out.shape == ctx.query.shape
    return launched, Counter(ops)


MODES = [dict(), dict(splits=4), dict(head_reduce="none", num_heads=8, num_kv_heads=2, head_dim=128),
         dict(head_reduce="majority", ratio=0.3), dict(threshold=1.0, dense_last_rows=0)]


@pytest.mark.parametrize("config", MODES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "-")
def test_a_sparse_chunk_launches_five_kernels_and_no_torch_op(monkeypatch, config):
    """No host sync (the meta tensors would raise), five Triton launches (six with split lists), nothing
    between them."""
    launched, ops = chunk_launches(monkeypatch, **config)
    split = config.get("splits", 1) > 1
    assert sum(launched.values()) == LAUNCHES + split and not ops, (launched, ops)
    assert launched["_select_kernel"] == 1 and launched["_lists_kernel"] == 1, launched
    assert launched["_merge_splits_kernel"] == split, launched


if __name__ == "__main__":
    with pytest.MonkeyPatch.context() as patch:
        print("mode triton_launches torch_ops")
        for config in MODES:
            launched, ops = chunk_launches(patch, **config)
            print(config or "default", dict(launched), dict(ops))
