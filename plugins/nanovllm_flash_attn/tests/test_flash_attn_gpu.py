"""The ``flash_attn`` backend's FA4 kernels against the ``torch`` reference on the GPU (``gpu`` marker; skipped
where the backend is unavailable, e.g. without the FA4 wheels): prefill chunks with history, a fresh
prompt, GQA, sliding windows, soft-cap, decode on both paths and in a CUDA graph, attend_chunk's lse, and the
engine end to end. Block sizes 16 and 64 load pages through cp.async; 128 at head dim 64 or 128 is one key
tile, which FA4 loads by TMA. Every cache slot no context owns holds NaN (on the TMA cases, except the tail of
each sequence's last page, which FA4 reads whole and needs finite), and block tables are padded with -1. The
tiny Mistral's window-layer calls, as the engine's hybrid KV makes them (the null block for blocks the window
left), are checked element by element against float64, and the engine against float32."""

from __future__ import annotations

import pytest
import torch
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.testing import HYBRID_BLOCK_SIZE, TINY_CONFIGS, PagedBatch
from nanovllm_flash_attn.availability import probe, unavailable_reason

REASON = unavailable_reason(probe())
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"flash_attn unavailable: {REASON}")]

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
LSE_TOL = 2e-3

# (dtype, head_dim, group, block_size); group 4 over 8 KV heads is the 32q/8kv of the 8B-class models
CASES = [
    (torch.bfloat16, 128, 4, 16),
    (torch.bfloat16, 128, 4, 128),  # TMA pages
    (torch.float16, 128, 1, 64),
    (torch.bfloat16, 64, 8, 128),  # TMA pages
    (torch.bfloat16, 256, 2, 16),
    (torch.float16, 32, 2, 16),
]
LENS = [(1, 1), (37, 37), (64, 300), (1, 129), (200, 1000), (5, 16)]  # (query_len, context_len)


def _id(case) -> str:
    dtype, d, g, bs = case
    return f"{str(dtype).removeprefix('torch.')}-d{d}-g{g}-bs{bs}"


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


@pytest.fixture
def flash():
    from nanovllm_flash_attn.backend import FlashAttnBackend

    return FlashAttnBackend()


def counted(backend):
    """``backend`` with its FA4 calls counted in ``backend.fa4_calls``."""
    fa4 = backend.fa4

    def call(*args, **kwargs):
        backend.fa4_calls += 1
        return fa4(*args, **kwargs)

    backend.fa4, backend.fa4_calls = call, 0
    return backend


def batch(lens, case, gen, kv_heads=2) -> PagedBatch:
    dtype, head_dim, group, block_size = case
    b = PagedBatch(lens, kv_heads, group, head_dim, block_size, dtype, "cuda", gen)
    b.tables[b.tables >= b.k_cache.shape[0]] = -1  # the engine pads with -1 only
    if block_size == _tile_n(head_dim):  # TMA reads a sequence's last page whole: its tail must be finite
        for cache in (b.k_cache, b.v_cache):
            cache.nan_to_num_(0.0)
    return b


def _tile_n(head_dim: int) -> int:
    """FA4's key tile on SM 9.x for a causal, windowless call (its interface's _tile_size_fwd_sm90)."""
    return 128 if head_dim <= 192 else 80


def phase(b: PagedBatch) -> PhaseMetadata:
    return PhaseMetadata(b.cu, b.ctx, b.tables, b.max_query_len, max(c for _, c in b.lens))


def new_kv(b: PagedBatch):
    """Each chunk's new keys/values, as the attention layer hands them over (already in the cache)."""
    bs, phys, slot = b.k_cache.shape[1], [], []
    for s, (q_len, ctx) in enumerate(b.lens):
        pos = torch.arange(ctx - q_len, ctx, device="cuda")
        phys.append(b.tables[s].long()[pos // bs])
        slot.append(pos % bs)
    phys, slot = torch.cat(phys), torch.cat(slot)
    return b.k_cache[phys, slot], b.v_cache[phys, slot]


def reference(b: PagedBatch, window=None, softcap=None):
    """Causal attention per sequence in float64, with a sliding window and Gemma 2's soft-cap
    (``softcap * tanh(scale * q.k / softcap)``): ``(out, lse)``."""
    out = torch.zeros(b.q.shape, dtype=torch.float64, device="cuda")
    lse = torch.zeros(b.q.shape[:2], dtype=torch.float64, device="cuda")
    group, bs = b.q.shape[1] // b.k_cache.shape[2], b.k_cache.shape[1]
    cu = b.cu.tolist()
    for s, (q_len, ctx) in enumerate(b.lens):
        pos = torch.arange(ctx, device="cuda")
        phys, slot = b.tables[s].long()[pos // bs], pos % bs
        keys = b.k_cache[phys, slot].double().repeat_interleave(group, 1)
        vals = b.v_cache[phys, slot].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", b.q[cu[s]:cu[s + 1]].double(), keys) * b.scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        at = torch.arange(ctx - q_len, ctx, device="cuda")[:, None]
        visible = pos[None, :] <= at
        if window is not None:
            visible &= pos[None, :] > at - window
        scores = scores.masked_fill(~visible, float("-inf"))
        lse[cu[s]:cu[s + 1]] = torch.logsumexp(scores, -1).T
        out[cu[s]:cu[s + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vals)
    return out, lse


def close(out, ref, what):
    assert out.shape == ref.shape and torch.isfinite(out).all(), f"{what}: NaN or unwritten output"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < TOL[out.dtype], f"{what}: relative error {err:.2e}"


def test_reference_is_the_torch_backend(gen):
    """The local reference (for soft-cap) agrees with the torch backend where both apply."""
    case = (torch.bfloat16, 64, 4, 16)
    b = batch(LENS, case, gen)
    k, v = new_kv(b)
    for window in (None, 50):
        ref = TorchBackend().prefill(b.q, k, v, b.k_cache, b.v_cache, phase(b), b.scale, window)
        close(ref, reference(b, window)[0].to(ref.dtype), f"reference, window {window}")


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("window", [None, 1, 100])
def test_prefill_with_history(flash, case, window, gen):
    b = batch(LENS, case, gen)
    k, v = new_kv(b)
    meta = phase(b)
    ref = TorchBackend().prefill(b.q, k, v, b.k_cache, b.v_cache, meta, b.scale, window)
    counted(flash)
    out = flash.prefill(b.q, k, v, b.k_cache, b.v_cache, meta, b.scale, window)
    assert flash.fa4_calls == 1
    close(out, ref, f"prefill {_id(case)} window {window}")


@pytest.mark.parametrize("case", CASES[:3], ids=_id)
@pytest.mark.parametrize("window", [None, 256])
def test_fresh_prompt(flash, case, window, gen):
    b = batch([(3000, 3000)], case, gen, kv_heads=8)
    k, v = new_kv(b)
    ref = TorchBackend().prefill(b.q, k, v, b.k_cache, b.v_cache, phase(b), b.scale, window)
    close(flash.prefill(b.q, k, v, b.k_cache, b.v_cache, phase(b), b.scale, window), ref, f"fresh {_id(case)}")


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[4]], ids=_id)
@pytest.mark.parametrize("window", [None, 64])
def test_softcap(flash, case, window, gen):
    b = batch(LENS, case, gen)
    b.q.mul_(4.0)  # scores well past the cap, so capping matters
    k, v = new_kv(b)
    out = flash.prefill(b.q, k, v, b.k_cache, b.v_cache, phase(b), b.scale, window, softcap=5.0)
    ref, _ = reference(b, window, softcap=5.0)
    close(out, ref.to(out.dtype), f"softcap prefill {_id(case)}")
    uncapped, _ = reference(b, window)
    assert ((uncapped - ref).norm() / ref.norm()).item() > 10 * TOL[out.dtype], "the case must exercise the cap"
    d = batch([(1, n) for n in (1, 70, 500)], case, gen)
    out = flash.decode(d.q, d.k_cache, d.v_cache, phase(d), d.scale, window, softcap=5.0)
    close(out, reference(d, window, softcap=5.0)[0].to(out.dtype), f"softcap decode {_id(case)}")


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("window", [None, 33])
def test_decode_on_both_paths(case, window, gen):
    """``decode="auto"`` runs the Triton kernel at a small batch and at a batch of several waves of query
    tiles; ``decode="fa4"`` runs FA4 on both; both close to the torch reference."""
    from nanovllm_flash_attn.backend import FlashAttnBackend, device_facts
    from nanovllm_flash_attn.config import FlashAttnConfig

    num_sms = device_facts(torch.cuda.current_device())[1]
    kv_heads = 8
    auto = counted(FlashAttnBackend())
    few = batch([(1, n) for n in (1, 17, 300, 2049)], case, gen, kv_heads)
    many = batch([(1, 1 + (97 * s) % 700) for s in range(-(-3 * num_sms // kv_heads))], case, gen, kv_heads)
    for b in (few, many):
        ref = TorchBackend().decode(b.q, b.k_cache, b.v_cache, phase(b), b.scale, window)
        close(auto.decode(b.q, b.k_cache, b.v_cache, phase(b), b.scale, window), ref, f"decode {_id(case)}")
        assert auto.fa4_calls == 0
        forced = counted(FlashAttnBackend(FlashAttnConfig(decode="fa4")))
        close(forced.decode(b.q, b.k_cache, b.v_cache, phase(b), b.scale, window), ref, f"fa4 decode {_id(case)}")
        assert forced.fa4_calls == 1


@pytest.mark.parametrize("case", CASES[:3], ids=_id)
def test_attend_chunk(flash, case, gen):
    lens = [(q, q) for q, _ in LENS]
    b = batch(lens, case, gen)
    k, v = new_kv(b)
    out, lse = flash.attend_chunk(b.q, k, v, phase(b), b.scale)
    ref_out, ref_lse = reference(b)
    close(out, ref_out.to(out.dtype), f"attend_chunk {_id(case)}")
    assert lse.shape == b.q.shape[:2] and lse.dtype == torch.float32 and lse.is_contiguous()
    assert (lse - ref_lse).abs().max().item() < LSE_TOL


def test_fa4_decode_in_a_cuda_graph(gen):
    """FA4's decode captured once, replayed with other lengths, tables and queries."""
    from nanovllm_flash_attn.backend import FlashAttnBackend
    from nanovllm_flash_attn.config import FlashAttnConfig

    dtype, head_dim, kv_heads, group, block_size, max_len, bs = torch.bfloat16, 128, 8, 4, 16, 3000, 5
    backend = counted(FlashAttnBackend(FlashAttnConfig(decode="fa4")))
    pool = -(-max_len // block_size) * bs + 4
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=gen).to(dtype).cuda()
    v_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=gen).to(dtype).cuda()
    q = torch.zeros(bs, kv_heads * group, head_dim, dtype=dtype, device="cuda")
    lens = torch.ones(bs, dtype=torch.int32, device="cuda")
    tables = torch.zeros(bs, -(-max_len // block_size), dtype=torch.int32, device="cuda")
    meta = PhaseMetadata(torch.arange(bs + 1, dtype=torch.int32, device="cuda"), lens, tables, 1, max_len)
    scale = head_dim**-0.5
    backend.decode(q, k_cache, v_cache, meta, scale)  # FA4 compiles outside the capture, as the runner's warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.decode(q, k_cache, v_cache, meta, scale)
    assert backend.fa4_calls == 2
    for _ in range(2):
        new_lens = torch.randint(1, max_len + 1, (bs,), generator=gen)
        lens.copy_(new_lens)
        tables.copy_(torch.randperm(pool, generator=gen)[: tables.numel()].view_as(tables).int())
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        close(out, TorchBackend().decode(q, k_cache, v_cache, meta, scale), "FA4 decode replayed")


class WindowBatch:
    """A sliding-window layer's phase as the engine's hybrid KV hands it over, for ``lens``
    ``[(query_len, context_len)]``: every position's keys and values in its sequence's blocks (scattered in
    the pool), except that the blocks the window left before the chunk (``KVCacheGroup.first_needed_block``)
    are freed: the table names the null block there (the pool's last block, zeroed) and the freed blocks hold
    NaN, as a block reused by another sequence holds anything. Tables are padded with -1 and ``q``, ``k``,
    ``v`` are views of one packed projection, as the layers pass them."""

    def __init__(self, lens, window, kv_heads, group, head_dim, block_size, dtype, gen):
        from nanovllm.kv.groups import KVCacheGroup

        self.lens, self.window, self.scale = lens, window, head_dim**-0.5
        width = [-(-ctx // block_size) for _, ctx in lens]
        pool = sum(width) + 4  # and the null block after them
        phys = torch.randperm(pool, generator=gen)
        self.keys = [torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype) for _, ctx in lens]
        self.values = [torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype) for _, ctx in lens]
        cache = torch.full((2, pool + 1, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
        cache[:, pool] = 0.0
        tables = torch.full((len(lens), max(width)), -1, dtype=torch.int32)
        group_kv = KVCacheGroup((0,), window)
        used = 0
        for s, (q_len, ctx) in enumerate(lens):
            blocks = phys[used: used + width[s]]
            used += width[s]
            pos = torch.arange(ctx)
            cache[0, blocks[pos // block_size], pos % block_size] = self.keys[s]
            cache[1, blocks[pos // block_size], pos % block_size] = self.values[s]
            freed = group_kv.first_needed_block(ctx - q_len, block_size)
            cache[:, blocks[:freed]] = float("nan")
            tables[s, : width[s]] = torch.cat([torch.full((freed,), pool), blocks[freed:]]).int()
        self.k_cache, self.v_cache = cache[0].cuda(), cache[1].cuda()
        q_lens = [q for q, _ in lens]
        qkv = torch.randn(sum(q_lens), kv_heads * (group + 2), head_dim, generator=gen).to(dtype).cuda()
        h = kv_heads * group
        self.q, self.k, self.v = qkv[:, :h], qkv[:, h: h + kv_heads], qkv[:, h + kv_heads:]
        self.k.copy_(torch.cat([keys[ctx - q:] for keys, (q, ctx) in zip(self.keys, lens)]))
        self.v.copy_(torch.cat([values[ctx - q:] for values, (q, ctx) in zip(self.values, lens)]))
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        self.meta = PhaseMetadata(cu.cuda(), torch.tensor([c for _, c in lens], dtype=torch.int32).cuda(),
                                  tables.cuda(), max(q_lens), max(c for _, c in lens))

    def run(self, backend):
        if self.meta.max_query_len == 1:
            return backend.decode(self.q, self.k_cache, self.v_cache, self.meta, self.scale, self.window)
        return backend.prefill(self.q, self.k, self.v, self.k_cache, self.v_cache, self.meta, self.scale,
                               self.window)

    def reference(self) -> torch.Tensor:
        """Each query over its window of keys, in float64 from the positions' keys and values themselves."""
        out, row, group = [], 0, self.q.shape[1] // self.k.shape[1]
        for (q_len, ctx), keys, values in zip(self.lens, self.keys, self.values):
            q = self.q[row: row + q_len].double().cpu()
            row += q_len
            scores = torch.einsum("qhd,khd->hqk", q, keys.double().repeat_interleave(group, 1)) * self.scale
            at, pos = torch.arange(ctx - q_len, ctx)[:, None], torch.arange(ctx)[None, :]
            scores = scores.masked_fill((pos > at) | (pos <= at - self.window), float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1),
                                    values.double().repeat_interleave(group, 1)))
        return torch.cat(out)


# the tiny Mistral of test_engine_against_float32: its window, heads and block size; its 300-token prompt in
# chunks of 128 (the first over its own keys only), then a batch of its decodes
_MISTRAL = TINY_CONFIGS["MistralForCausalLM"]
TINY_MISTRAL = dict(window=_MISTRAL["sliding_window"], kv_heads=_MISTRAL["num_key_value_heads"],
                    group=_MISTRAL["num_attention_heads"] // _MISTRAL["num_key_value_heads"],
                    head_dim=_MISTRAL["head_dim"], block_size=HYBRID_BLOCK_SIZE)
MISTRAL_PHASES = [[(128, 128)], [(128, 256)], [(44, 300)], [(1, 20 + 30 * i + 9) for i in range(5)]]


@pytest.mark.parametrize("lens", MISTRAL_PHASES, ids=["fresh", "history", "last-chunk", "decodes"])
def test_tiny_mistral_window_calls_are_within_bf16_rounding(lens, gen):
    """The engine's window-layer calls of the tiny Mistral, on FA4 (decode forced) and on Triton: every
    output element within a few bfloat16 rounding steps of the float64 reference. A key the window should
    hide or show, a page read where the null block or the padding is, or a query offset by the history moves
    outputs by whole softmax weights, far beyond that bound."""
    from nanovllm.attention.triton_backend import TritonBackend
    from nanovllm_flash_attn.backend import FlashAttnBackend
    from nanovllm_flash_attn.config import FlashAttnConfig

    b = WindowBatch(lens, dtype=torch.bfloat16, gen=gen, **TINY_MISTRAL)
    ref = b.reference()
    bound = 2**-7 * max(v.abs().max().item() for v in b.values)  # a bfloat16 step at the largest values
    fa4 = counted(FlashAttnBackend(FlashAttnConfig(decode="fa4")))
    for name, backend in (("fa4", fa4), ("triton", TritonBackend())):
        out = b.run(backend)
        assert torch.isfinite(out).all(), f"{name}: NaN or unwritten output"
        err = (out.double().cpu() - ref).abs().max().item()
        assert err < bound, f"{name}: {err:.3g} from the float64 reference (bound {bound:.3g})"
    assert fa4.fa4_calls == 1


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "MistralForCausalLM"])
def test_engine_against_float32(tiny_model, architecture):
    """The engine on ``flash_attn`` (FA4 decode forced, so the small batches run it too; Mistral slides a
    window on every layer) is as close to the float32 ``torch`` backend's prompt logprobs as the Triton
    backend in bfloat16 is, and its decode graphs give its eager tokens.

    Both bfloat16 backends are compared with float32, not with each other: two correct bfloat16 kernels
    round differently (FA4 and Triton both round the softmax weights to bfloat16, at different points), and
    on the tiny Mistral, whose attention is sharp, that moves prompt logprobs by tenths, the same order as
    either's distance from float32. A mask off by one key moves them by whole units."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.testing import prompt_logprobs

    path = tiny_model(architecture)
    # the prompt prefills in chunks over their history
    options = dict(device="cuda", block_size=HYBRID_BLOCK_SIZE, kv_cache_memory=1 << 26, max_num_seqs=8,
                   max_model_len=512, max_num_batched_tokens=128)
    prompt = [(7 * i + 3) % 250 + 3 for i in range(300)]
    exact = prompt_logprobs(LLM(path, attention_backend="torch", dtype="float32", **options), prompt)
    flash = LLM(path, attention_backend="flash_attn:decode=fa4", dtype="bfloat16", **options)
    assert flash.runner.backend.name == "flash_attn" and flash.runner.cuda_graphs.graphs
    triton = LLM(path, attention_backend="triton", dtype="bfloat16", **options)

    def distance(llm) -> tuple[float, float]:
        errors = [abs(a - b) for a, b in zip(prompt_logprobs(llm, prompt), exact, strict=True)]
        return max(errors), sum(errors) / len(errors)

    (ours_max, ours_mean), (theirs_max, theirs_mean) = distance(flash), distance(triton)
    report = (f"from float32: flash_attn max {ours_max:.3g} mean {ours_mean:.3g}, "
              f"triton max {theirs_max:.3g} mean {theirs_mean:.3g}")
    assert ours_max <= 1.5 * theirs_max + 0.01 and ours_mean <= 1.5 * theirs_mean + 0.002, report
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [prompt[: 20 + 30 * i] for i in range(5)]
    with_graphs = [o.token_ids for o in flash.generate(prompts, params, use_tqdm=False)]
    eager = LLM(path, attention_backend="flash_attn:decode=fa4", dtype="bfloat16", enforce_eager=True,
                **options)
    assert [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)] == with_graphs
