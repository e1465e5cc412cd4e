"""The sparse prefill policies read no length back from the device when the phase carries its lengths on
the host (``PhaseMetadata.query_lens_host`` / ``context_lens_host``), and compute the same with and
without them.

On a GPU such a read is a host sync: it stalls the queue of launches behind it. Here the policies run on
the CPU (their torch references, and XAttention's chunk cut into estimate slices) while a dispatch mode
records every host read of a value computed from the phase's length tensors alone: ``.item()``, ``int()``,
``bool()``, ``.tolist()``. Values that also depend on the data (scores, masks) are not counted: reading
them is the references' own business, which the Triton kernels do without."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

pytest.importorskip("nanovllm_xattn")
pytest.importorskip("nanovllm_minference")

from nanovllm.attention.metadata import PhaseMetadata  # noqa: E402
from nanovllm.attention.torch_backend import TorchBackend  # noqa: E402
from nanovllm.sparse import PolicyContext  # noqa: E402
from nanovllm_minference.config import MInferenceConfig  # noqa: E402
from nanovllm_minference.policy import MInferencePolicy  # noqa: E402
from nanovllm_xattn.config import XAttentionConfig  # noqa: E402
from nanovllm_xattn.policy import XAttentionPolicy  # noqa: E402

BLOCK_SIZE = 16
HISTORIES, CHUNKS = (200, 0, 37), (100, 60, 90)  # three sequences: a later chunk, a first one, a ragged one


class LengthReads(TorchDispatchMode):
    """Records (in ``reads``) each host read of a value computed from ``sources`` alone: every op whose
    tensor inputs all derive from them gives a tensor that does too."""

    def __init__(self, sources: list[torch.Tensor]) -> None:
        super().__init__()
        self.derived = {id(t): t for t in sources}  # the tensors kept alive, so their ids stay theirs
        self.reads: list[str] = []

    def from_lengths(self, *tensors: object) -> bool:
        inputs = [t for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)]
        return bool(inputs) and all(id(t) in self.derived for t in inputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from_lengths = self.from_lengths(args, kwargs)
        name = func.name()
        if from_lengths and name in ("aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero"):
            self.reads.append(name)
        out = func(*args, **kwargs)
        if from_lengths:
            self.derived.update((id(t), t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@pytest.fixture
def length_reads(monkeypatch):
    """``watch(meta)`` -> the :class:`LengthReads` of ``meta``'s length tensors; ``.tolist()`` (which
    dispatches no op) is counted too."""
    modes: list[LengthReads] = []
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        for mode in modes:
            if id(self) in mode.derived:
                mode.reads.append("tolist")
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    def watch(meta: PhaseMetadata) -> LengthReads:
        modes.append(LengthReads([meta.cu_seqlens_q, meta.context_lens]))
        return modes[-1]

    return watch


def batch(num_heads: int = 4, num_kv_heads: int = 1, head_dim: int = 32, seed: int = 0):
    """Three sequences' prefill chunks over a paged cache (shuffled blocks) that already holds every key,
    as a policy sees them: ``(q, k, v, context)``, the metadata without host copies."""
    g = torch.Generator().manual_seed(seed)
    lens = [h + c for h, c in zip(HISTORIES, CHUNKS, strict=True)]
    width = -(-max(lens) // BLOCK_SIZE)
    blocks = torch.randperm(len(lens) * width, generator=g).int().view(len(lens), width)
    cache = torch.zeros(2, len(lens) * width, BLOCK_SIZE, num_kv_heads, head_dim)
    qs, ks, vs = [], [], []
    for s, (history, n) in enumerate(zip(HISTORIES, lens, strict=True)):
        keys = torch.randn(2, n, num_kv_heads, head_dim, generator=g)
        pos = torch.arange(n)
        cache[:, blocks[s, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE] = keys
        qs.append(torch.randn(n - history, num_heads, head_dim, generator=g))
        ks.append(keys[0, history:])
        vs.append(keys[1, history:])
    cu = torch.tensor([0, *torch.tensor(CHUNKS).cumsum(0).tolist()], dtype=torch.int32)
    meta = PhaseMetadata(cu, torch.tensor(lens, dtype=torch.int32), blocks, max(CHUNKS), max(lens))
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    ctx = PolicyContext(3, True, q, meta, cache[0], cache[1], head_dim**-0.5, TorchBackend(), None, k, v)
    return q, k, v, ctx


def with_host_lens(ctx: PolicyContext) -> PolicyContext:
    meta = attrs.evolve(ctx.meta, query_lens_host=CHUNKS,
                        context_lens_host=tuple(h + c for h, c in zip(HISTORIES, CHUNKS, strict=True)))
    return attrs.evolve(ctx, meta=meta)


POLICIES = {
    "xattn": lambda: XAttentionPolicy(XAttentionConfig(block_size=64, dense_below=0)),
    "xattn-estimate-slices": lambda: XAttentionPolicy(XAttentionConfig(block_size=64, dense_below=0,
                                                                       estimate_chunk=64)),
    "minference": lambda: MInferencePolicy(MInferenceConfig(dense_below=0, vertical_size=32, slash_size=64,
                                                            last_q=16, dense_above=None)),
    "minference-density": lambda: MInferencePolicy(MInferenceConfig(dense_below=0, vertical_size=32,
                                                                    slash_size=64, last_q=16)),
    "minference-block-sparse": lambda: MInferencePolicy(MInferenceConfig(dense_below=0, top_k_blocks=2,
                                                                         pattern="block_sparse")),
}


@pytest.mark.parametrize("name", POLICIES)
def test_a_prefill_with_host_lengths_reads_none_back_and_computes_the_same(name, length_reads):
    q, k, v, ctx = batch()
    policy = POLICIES[name]()
    read_back = length_reads(ctx.meta)
    with read_back:
        without = policy.compute_chunked_prefill(q, k, v, ctx)
    assert read_back.reads, "without host copies the torch path reads the lengths from the tensors"
    hosted = with_host_lens(ctx)
    no_reads = length_reads(hosted.meta)
    with no_reads:
        out = policy.compute_chunked_prefill(q, k, v, hosted)
    assert no_reads.reads == []
    assert torch.equal(out, without)


def on_cuda(ctx: PolicyContext) -> PolicyContext:
    meta = ctx.meta
    meta = attrs.evolve(meta, cu_seqlens_q=meta.cu_seqlens_q.cuda(), context_lens=meta.context_lens.cuda(),
                        block_tables=meta.block_tables.cuda())
    return PolicyContext(ctx.layer_id, True, ctx.query.cuda(), meta, ctx.k_cache.cuda(), ctx.v_cache.cuda(),
                         ctx.scale, TorchBackend(), None, ctx.new_keys.cuda(), ctx.new_values.cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("name", POLICIES)
def test_on_the_gpu_a_prefill_with_host_lengths_never_waits_for_the_gpu(name):
    """CUDA's sync debug mode raises on every op that makes the host wait for the GPU (a read back, a copy
    from pageable memory); the first call compiles the kernels and makes the per-layer state."""
    _, _, _, ctx = batch()
    ctx = on_cuda(with_host_lens(ctx))
    policy = POLICIES[name]()
    policy.compute_chunked_prefill(ctx.query, ctx.new_keys, ctx.new_values, ctx)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        policy.compute_chunked_prefill(ctx.query, ctx.new_keys, ctx.new_values, ctx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
