"""The ``flash_attn`` backend without FA4 or a GPU: registration and listing, the unavailable reason, the
selection error, the rules that pick FA4 or Triton, and the argument mapping, checked end to end against
the ``torch`` reference through a stand-in for ``flash_attn_varlen_func`` written from FA4's documented
semantics, on kernel inputs and inside the engine (hybrid KV, chunked prefill, batched decodes).
``test_flash_attn_gpu.py`` checks the real kernels."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.cli import main
from nanovllm.plugins import PluginError, reload_plugins
from nanovllm.selection import SelectionError, make_config, resolve_attention_backend
from nanovllm.testing import PagedBatch
from nanovllm_flash_attn import availability, backend, dispatch
from nanovllm_flash_attn.availability import Machine, unavailable_reason
from nanovllm_flash_attn.config import FlashAttnConfig

H200 = (("NVIDIA H200", 9, 0),)
READY = Machine("4.0.0b36", True, True, H200)


@pytest.fixture
def plugins():
    yield reload_plugins()
    reload_plugins()


# -- availability ------------------------------------------------------------------------------------------


def test_ready_machine_has_no_reason():
    assert unavailable_reason(READY) is None
    assert unavailable_reason(Machine("4.0.0b36", True, True, (("NVIDIA B200", 10, 0),))) is None


@pytest.mark.parametrize("machine, expected", [
    (Machine(None, False, True, H200), r"FlashAttention-4 is not installed: pip install 'nanovllm-flash-attn\[fa4\]'"),
    (Machine("4.0.0b36", False, True, H200), r"CuTe DSL is not importable .* nvidia_cutlass_dsl/dsl_packages folder on PYTHONPATH"),
    (Machine("4.0.0b36", True, False, H200), r"Triton is not installed .* pip install triton"),
    (Machine("4.0.0b36", True, True, (), "no NVIDIA driver"), r"no NVIDIA GPU \(no NVIDIA driver\).*'torch' on the CPU"),
    (Machine("4.0.0b36", True, True, (("NVIDIA A100", 8, 0), ("RTX 5090", 12, 0))),
     r"NVIDIA A100 \(SM 8.0\), RTX 5090 \(SM 12.0\): FA4's paged-KV forward needs SM 9.x .*'triton'"),
])
def test_each_missing_piece_is_named_with_its_fix(machine, expected):
    assert re.search(expected, unavailable_reason(machine))


def test_every_reason_is_reported_at_once():
    reason = unavailable_reason(Machine(None, False, False, (), "NVML lists no GPU"))
    parts = ("FlashAttention-4 is not installed", "; Triton is not installed", "; no NVIDIA GPU (NVML lists no GPU)")
    assert all(p in reason for p in parts)
    assert sorted(parts, key=reason.index) == list(parts)


def test_hidden_gpus_count_as_none(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert availability._nvml_gpus() == ((), "CUDA_VISIBLE_DEVICES='' hides every GPU")
    assert "no NVIDIA GPU" in unavailable_reason(availability.probe())


# -- registration, listing, selection ----------------------------------------------------------------------


def test_registered_with_what_it_supports(plugins):
    info = plugins.registry.attention_backends["flash_attn"]
    assert info.dist == "nanovllm-flash-attn" and info.target == "nanovllm_flash_attn.backend:FlashAttnBackend"
    assert info.devices == ("cuda",) and info.dtypes == ("float16", "bfloat16")
    assert info.head_sizes == (32, 64, 128, 256)
    assert info.unavailable == unavailable_reason(availability.probe())


def test_listing_imports_nothing_heavy():
    code = ("import sys; from nanovllm.plugins import discover; "
            "assert 'flash_attn' in discover().registry.attention_backends; "
            "heavy = [m for m in ('torch', 'triton', 'flash_attn', 'cutlass', 'nanovllm_flash_attn.backend') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_check_loads_the_backend_class_without_fa4(plugins):
    """``nanovllm plugins --check`` loads the class (FA4 is imported only when an engine builds it)."""
    plugins.check()
    ours = next(p for p in plugins.plugins if p.dist == "nanovllm-flash-attn")
    assert ours.error is None and ours.problems == {}


def _unavailable(monkeypatch, machine: Machine):
    monkeypatch.setattr(availability, "probe", lambda: machine)
    import nanovllm_flash_attn.plugin as plugin_mod
    monkeypatch.setattr(plugin_mod, "probe", lambda: machine)
    return reload_plugins()


def test_unavailable_is_listed_with_the_reason(monkeypatch, capsys, plugins):
    _unavailable(monkeypatch, Machine(None, True, True, (), "no NVIDIA driver"))
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    listed = out[out.index("nanovllm-flash-attn"):]
    assert listed.splitlines()[1:3] == [
        "    attention_backend:flash_attn",
        f"        unavailable: {unavailable_reason(Machine(None, True, True, (), 'no NVIDIA driver'))}",
    ]
    assert "FAILED" not in out


@pytest.mark.parametrize("name", ["flash_attn", "FLASH_ATTN"])  # vLLM's name, any case
def test_selecting_an_unavailable_backend_names_the_fix(monkeypatch, plugins, name):
    ps = _unavailable(monkeypatch, Machine(None, True, True, H200))
    with pytest.raises(PluginError, match=r"attention backend 'flash_attn' \(distribution nanovllm-flash-attn\) is "
                       r"unavailable on this machine: FlashAttention-4 is not installed: pip install"):
        resolve_attention_backend(name, ps)
    info = ps.registry.attention_backends["flash_attn"]
    assert info.supports("cuda", "bfloat16", 128).startswith("unavailable on this machine: FlashAttention-4")


def test_available_backend_resolves_with_its_options(monkeypatch, plugins):
    ps = _unavailable(monkeypatch, READY)
    choice = resolve_attention_backend("flash_attn:decode=triton", ps)
    assert choice.info.name == "flash_attn" and choice.config == FlashAttnConfig(decode="triton")
    assert choice.info.supports("cuda", "bfloat16", 128) is None
    assert "dtype float32" in choice.info.supports("cuda", "float32", 128)
    with pytest.raises(SelectionError, match="decode must be one of 'auto', 'fa4', 'triton', got 'splitkv'"):
        make_config(FlashAttnConfig, {"decode": "splitkv"}, "attention backend 'flash_attn'")


def test_building_without_fa4_names_the_fix():
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("FA4 is installed here")
    with pytest.raises(ImportError, match=r"pip install 'nanovllm-flash-attn\[fa4\]'.*attention_backend='triton'"):
        backend.FlashAttnBackend()


# -- which kernel runs -------------------------------------------------------------------------------------


def test_fa4_refusals():
    assert dispatch.fa4_refusal((9, 0), "bfloat16", 128) is None
    assert dispatch.fa4_refusal((9, 0), "float16", 256) is None
    assert dispatch.fa4_refusal((10, 0), "bfloat16", 64) is None
    assert "SM 8.0" in dispatch.fa4_refusal((8, 0), "bfloat16", 128)
    assert "SM 12.0" in dispatch.fa4_refusal((12, 0), "bfloat16", 128)
    assert "dtype float32" in dispatch.fa4_refusal((9, 0), "float32", 128)
    assert "head dim 72" in dispatch.fa4_refusal((9, 0), "bfloat16", 72)  # cp.async pages need multiples of 16
    assert dispatch.fa4_refusal((9, 0), "bfloat16", 192) is None
    assert "head dim 192" in dispatch.fa4_refusal((10, 0), "bfloat16", 192)
    assert "head dim 512" in dispatch.fa4_refusal((9, 0), "bfloat16", 512)
    for arch, dim in [((9, 0), d) for d in (32, 64, 128, 256)] + [((10, 0), d) for d in (32, 64, 128, 256)]:
        assert dispatch.fa4_refusal(arch, "bfloat16", dim) is None, "every registered head size runs on FA4"


def test_window_mapping():
    assert dispatch.window_size(None) == (None, None)
    assert dispatch.window_size(1) == (0, 0)  # the query's own key only
    assert dispatch.window_size(4096) == (4095, 0)
    with pytest.raises(ValueError, match="window 0"):
        dispatch.window_size(0)


def _meta(lens, block_size=16):
    """PhaseMetadata of ``[(query_len, context_len)]`` with -1-padded block tables."""
    q_lens = torch.tensor([q for q, _ in lens])
    blocks = [-(-c // block_size) for _, c in lens]
    tables = torch.full((len(lens), max(blocks) + 1), -1, dtype=torch.int32)
    for s, n in enumerate(blocks):
        tables[s, :n] = torch.arange(sum(blocks[:s]), sum(blocks[:s]) + n)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int()])
    return PhaseMetadata(cu, torch.tensor([c for _, c in lens], dtype=torch.int32), tables,
                         max(q for q, _ in lens), max(c for _, c in lens))


def test_paged_args_map_the_phase_metadata():
    meta = _meta([(5, 40), (1, 17), (3, 3)])
    args = dispatch.paged_args(meta, 0.125)
    assert args.pop("cu_seqlens_q") is meta.cu_seqlens_q and args.pop("seqused_k") is meta.context_lens
    assert args.pop("page_table") is meta.block_tables
    assert args == dict(max_seqlen_q=5, max_seqlen_k=40, softmax_scale=0.125, causal=True, window_size=(None, None),
                        softcap=0.0, num_splits=1)
    windowed = dispatch.paged_args(meta, 0.125, window=8, softcap=30.0)
    assert windowed["window_size"] == (7, 0) and windowed["softcap"] == 30.0
    assert torch.equal(windowed["page_table"], meta.block_tables.clamp(min=0))  # no -1 page reaches FA4


def test_dense_args_pair_each_chunk_with_its_own_keys():
    meta = _meta([(5, 5), (2, 2)])
    args = dispatch.dense_args(meta, 0.5, return_lse=True)
    assert args.pop("cu_seqlens_q") is meta.cu_seqlens_q and args.pop("cu_seqlens_k") is meta.cu_seqlens_q
    assert args == dict(max_seqlen_q=5, max_seqlen_k=5, softmax_scale=0.5, causal=True, window_size=(None, None),
                        softcap=0.0, num_splits=1, return_lse=True)


# -- the backend end to end, on a stand-in for FA4 ---------------------------------------------------------


def fake_varlen(q, k, v, *, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap,
                num_splits, cu_seqlens_k=None, seqused_k=None, page_table=None, return_lse=False):
    """``flash_attn_varlen_func`` as FA4's source defines it, in float64: paged keys through ``page_table``
    and ``seqused_k`` or packed keys through ``cu_seqlens_k``; causal aligned bottom-right; ``window_size``
    (left, right) around that diagonal; scores ``softcap * tanh(s / softcap)``; lse ``[H, total_q]``."""
    assert causal and num_splits == 1 and (page_table is None) == (seqused_k is None) != (cu_seqlens_k is None)
    fake_varlen.calls += 1
    fake_varlen.pages.append(None if page_table is None else (page_table, seqused_k, k.shape[0] - 1))
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    group = q.shape[1] // k.shape[-2]
    cu = cu_seqlens_q.tolist()
    for b in range(len(cu) - 1):
        if page_table is not None:
            n = int(seqused_k[b])
            pos = torch.arange(n)
            page = page_table[b].long()[pos // k.shape[1]]
            assert (page >= 0).all(), "FA4 reads the page of every key it loads"
            keys, vals = k[page, pos % k.shape[1]], v[page, pos % k.shape[1]]
        else:
            keys, vals = k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]], v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]
        n_q, n_k = cu[b + 1] - cu[b], keys.shape[0]
        assert n_q <= max_seqlen_q and n_k <= max_seqlen_k
        keys = keys.double().repeat_interleave(group, dim=1)
        vals = vals.double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[cu[b]:cu[b + 1]].double(), keys) * softmax_scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        diag = torch.arange(n_q)[:, None] + n_k - n_q  # the key each query sits on
        key = torch.arange(n_k)[None, :]
        left, right = window_size
        visible = key <= diag + (0 if right is None else right)
        if left is not None:
            visible &= key >= diag - left
        s = s.masked_fill(~visible, float("-inf"))
        lse[cu[b]:cu[b + 1]] = torch.logsumexp(s, -1).T
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vals)
    return out.to(q.dtype), lse.T.float().contiguous()


class TritonSpy:
    """Stands in for the Triton backend: the torch reference, counting calls."""

    def __init__(self):
        self.calls = []
        self.torch = TorchBackend()

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append(name)
            return getattr(self.torch, name)(*args, **kwargs)
        return call


@pytest.fixture
def fa(monkeypatch):
    """The backend on the CPU with the stand-in as FA4, on a 132-SM GPU that FA4 takes."""
    fake_varlen.calls, fake_varlen.pages = 0, []
    monkeypatch.setattr(backend, "load_fa4", lambda: fake_varlen)
    monkeypatch.setattr(backend.FlashAttnBackend, "refusal", lambda self, q: None)
    monkeypatch.setattr(backend, "device_facts", lambda index: ((9, 0), 132))

    def make(**options):
        b = backend.FlashAttnBackend(FlashAttnConfig(**options))
        b.fallback = TritonSpy()
        return b
    return make


def _batch(lens, block_size=16, kv_heads=2, group=4, head_dim=32, seed=0):
    """A PagedBatch (NaN in every slot no context owns) whose tables are padded with -1 only, as the engine's
    are (the torch reference reads every entry that is not -1)."""
    b = PagedBatch(lens, kv_heads, group, head_dim, block_size, torch.float32, "cpu",
                   torch.Generator().manual_seed(seed))
    b.tables[b.tables >= b.k_cache.shape[0]] = -1
    return b


def _phase(b: PagedBatch) -> PhaseMetadata:
    return PhaseMetadata(b.cu, b.ctx, b.tables, b.max_query_len, max(c for _, c in b.lens))


def _new_kv(b: PagedBatch):
    """Each chunk's new keys/values, read back from the cache (they are there before attention runs)."""
    bs, rows = b.k_cache.shape[1], []
    for s, (q_len, ctx) in enumerate(b.lens):
        pos = torch.arange(ctx - q_len, ctx)
        rows.append((b.tables[s].long()[pos // bs], pos % bs))
    return [torch.cat([c[p, o] for p, o in rows]) for c in (b.k_cache, b.v_cache)]


@pytest.mark.parametrize("window", [None, 1, 7, 40])
@pytest.mark.parametrize("lens", [
    [(20, 20), (9, 50), (1, 33), (30, 64)],
    [(20, 20), (5, 20)],  # the longest chunk is a whole context, yet the second has history
], ids=["mixed", "max-query-is-max-context"])
def test_prefill_with_history_matches_the_torch_backend(fa, window, lens):
    b = _batch(lens)
    k, v = _new_kv(b)
    meta = _phase(b)
    ref = TorchBackend().prefill(b.q, k, v, b.k_cache, b.v_cache, meta, b.scale, window)
    flash = fa()
    out = flash.prefill(b.q, k, v, b.k_cache, b.v_cache, meta, b.scale, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert fake_varlen.calls == 1 and flash.fallback.calls == []


def test_fresh_single_sequence_reads_its_new_keys_not_the_cache(fa):
    b = _batch([(45, 45)])
    k, v = _new_kv(b)
    meta = _phase(b)
    ref = TorchBackend().prefill(b.q, k, v, b.k_cache, b.v_cache, meta, b.scale, 16)
    nan_cache = torch.full_like(b.k_cache, float("nan"))
    out = fa().prefill(b.q, k, v, nan_cache, nan_cache, meta, b.scale, 16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_softcap_caps_the_scaled_scores(fa):
    b = _batch([(12, 30), (4, 4)])
    k, v = _new_kv(b)
    meta, cap = _phase(b), 0.5
    capped = fa().prefill(b.q, k, v, b.k_cache, b.v_cache, meta, b.scale, softcap=cap)
    plain = fa().prefill(b.q, k, v, b.k_cache, b.v_cache, meta, b.scale)
    # the cap shrinks every score into (-cap, cap); check one row by hand
    s, pos = 0, 29  # sequence 0's last query, at position 29
    table = b.tables[0].long()
    keys = b.k_cache[table[torch.arange(30) // 16], torch.arange(30) % 16]
    vals = b.v_cache[table[torch.arange(30) // 16], torch.arange(30) % 16]
    row = b.cu[s] + 11
    for h in range(b.q.shape[1]):
        scores = keys[: pos + 1, h // 4].double() @ b.q[row, h].double() * b.scale
        expected = torch.softmax(cap * torch.tanh(scores / cap), 0) @ vals[: pos + 1, h // 4].double()
        torch.testing.assert_close(capped[row, h].double(), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(capped, plain, atol=1e-3)


def test_decode_runs_triton_unless_capped_or_fa4_is_chosen(fa):
    """``decode="auto"`` runs the Triton kernel at every batch and page size, FA4 only for a soft-cap (which
    the Triton kernel lacks); ``decode="fa4"`` runs FA4 and ``decode="triton"`` Triton, a soft-cap aside."""
    auto, forced, triton = fa(), fa(decode="fa4"), fa(decode="triton")
    for seed, (num_seqs, block_size) in enumerate([(1, 16), (1, 128), (64, 16), (64, 128)]):
        b = _batch([(1, 1 + (37 * n) % 300) for n in range(num_seqs)], block_size=block_size, seed=seed)
        meta = _phase(b)
        for flash, on_fa4 in ((auto, False), (forced, True), (triton, False)):
            assert flash.decode_runs_fa4(b.q) is on_fa4 and flash.decode_runs_fa4(b.q, softcap=5.0)
            for window in (None, 5):
                calls = fake_varlen.calls, len(flash.fallback.calls)
                ref = TorchBackend().decode(b.q, b.k_cache, b.v_cache, meta, b.scale, window)
                out = flash.decode(b.q, b.k_cache, b.v_cache, meta, b.scale, window)
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
                ran = (fake_varlen.calls - calls[0], len(flash.fallback.calls) - calls[1])
                assert ran == (on_fa4, not on_fa4)


def test_decode_option_and_softcap_override_the_batch_rule(fa):
    small = _batch([(1, 40)], seed=3)
    meta = _phase(small)
    forced = fa(decode="fa4")
    forced.decode(small.q, small.k_cache, small.v_cache, meta, small.scale)
    assert fake_varlen.calls == 1 and forced.fallback.calls == []
    capped = fa(decode="triton")
    capped.decode(small.q, small.k_cache, small.v_cache, meta, small.scale, softcap=20.0)  # Triton has no cap
    assert fake_varlen.calls == 2 and capped.fallback.calls == []
    big = _batch([(1, 8)] * 70, seed=4)
    never = fa(decode="triton")
    never.decode(big.q, big.k_cache, big.v_cache, _phase(big), big.scale)
    assert never.fallback.calls == ["decode"] and fake_varlen.calls == 2


def test_attend_chunk_returns_lse_per_token_and_head(fa):
    b = _batch([(17, 17), (5, 5), (1, 1)], seed=5)
    k, v = _new_kv(b)
    meta = _phase(b)
    ref_out, ref_lse = TorchBackend().attend_chunk(b.q, k, v, meta, b.scale)
    out, lse = fa().attend_chunk(b.q, k, v, meta, b.scale)
    assert lse.shape == (b.q.shape[0], b.q.shape[1]) and lse.is_contiguous() and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_attend_blocks_and_store_kv_run_triton(fa):
    flash = fa()
    b = _batch([(1, 40), (1, 20)], seed=6)
    meta = _phase(b)
    picks = torch.tensor([[0, 2], [1, -1]], dtype=torch.int32)
    out, lse = flash.attend_blocks(b.q, b.k_cache, b.v_cache, meta, picks, b.ctx, b.scale)
    ref_out, ref_lse = TorchBackend().attend_blocks(b.q, b.k_cache, b.v_cache, meta, picks, b.ctx, b.scale)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    cache = torch.zeros(4, 16, 2, 32)
    flash.store_kv(torch.ones(3, 2, 32), torch.ones(3, 2, 32), cache, cache.clone(), torch.tensor([0, -1, 17]))
    assert flash.fallback.calls == ["attend_blocks", "store_kv"] and fake_varlen.calls == 0
    assert cache.view(-1, 2, 32)[[0, 17]].eq(1).all() and cache.sum() == 2 * 2 * 32


def test_a_call_fa4_refuses_runs_triton_unless_it_needs_softcap(fa, monkeypatch):
    flash = fa()
    monkeypatch.setattr(backend.FlashAttnBackend, "refusal", lambda self, q: "dtype float32: FA4 takes 16-bit")
    b = _batch([(6, 30)], seed=7)
    k, v = _new_kv(b)
    meta = _phase(b)
    flash.prefill(b.q, k, v, b.k_cache, b.v_cache, meta, b.scale)
    flash.attend_chunk(b.q, k, v, meta, b.scale)
    assert flash.fallback.calls == ["prefill", "attend_chunk"] and fake_varlen.calls == 0
    with pytest.raises(ValueError, match="softcap=30.0 needs FA4, which cannot run this call: dtype float32"):
        flash.prefill(b.q, k, v, b.k_cache, b.v_cache, meta, b.scale, softcap=30.0)


def test_refusal_reads_the_device_dtype_and_head_dim(monkeypatch):
    monkeypatch.setattr(backend, "device_facts", lambda index: ((9, 0), 132))
    refusal = backend.FlashAttnBackend.refusal
    assert "device cpu" in refusal(None, torch.zeros(1, 2, 64))
    cuda_like = type("Q", (), {"device": torch.device("cuda", 0), "dtype": torch.bfloat16, "shape": (3, 4, 72)})
    assert "head dim 72" in refusal(None, cuda_like)
    cuda_like.shape = (3, 4, 128)
    assert refusal(None, cuda_like) is None


@pytest.mark.parametrize("architecture", ["MistralForCausalLM", "Gemma3ForCausalLM"])
def test_engine_through_the_fa4_mapping_matches_the_torch_backend(fa, tiny_model, one_thread, architecture):
    """The engine's own metadata through the backend's FA4 mapping (the stand-in as FA4, float32, decode
    forced onto it): hybrid KV, whose window groups name the blocks that left their window by the null block
    and pad their tables with -1, prompts prefilled in chunks over their history, and decodes batched over
    sequences of different lengths give the torch backend's prompt logprobs and greedy tokens."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.testing import HYBRID_BLOCK_SIZE, HYBRID_WINDOW, prompt_logprobs

    path = tiny_model(architecture)
    options = dict(device="cpu", dtype="float32", attention_backend="torch", block_size=HYBRID_BLOCK_SIZE,
                   kv_cache_memory=1 << 24, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=48)
    reference, engine = LLM(path, **options), LLM(path, **options)
    flash = fa(decode="fa4")
    for layer in engine.runner.attention_layers:
        layer.bind(flash, layer.hooks)
    prompt = [(7 * i + 3) % 250 + 3 for i in range(150)]  # chunks of 48: the window crossed many times
    ours, theirs = prompt_logprobs(engine, prompt), prompt_logprobs(reference, prompt)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4
    params = SamplingParams(temperature=0, max_tokens=2 * HYBRID_WINDOW, ignore_eos=True)
    prompts = [prompt[: 10 + 37 * i] for i in range(4)]
    calls = fake_varlen.calls
    assert ([o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
            == [o.token_ids for o in reference.generate(prompts, params, use_tqdm=False)])
    assert fake_varlen.calls - calls > 2 * HYBRID_WINDOW and set(flash.fallback.calls) == {"store_kv"}
    paged = [p for p in fake_varlen.pages if p is not None]
    assert any((table == null).any() for table, _, null in paged), "no window group freed a block"
    pages_used = [(-(-used // HYBRID_BLOCK_SIZE)).tolist() for _, used, _ in paged]
    assert any(max(n) > min(n) for n in pages_used), "no table had padding"
