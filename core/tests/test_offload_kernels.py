"""The offload engine's per-piece Triton kernels against their torch references (exact: integers and
copies), on CUDA (``gpu``) and at small sizes under Triton's interpreter in a subprocess on machines
without CUDA; and the references against a plain loop over every virtual sequence and token."""

from __future__ import annotations

import os
import random

import pytest
import torch
from nanovllm.kv.offload import (
    cached_piece_reference,
    load_misses,
    patch_slot_reference,
    selected_piece_reference,
)

CUDA = torch.cuda.is_available()
INTERP = (not CUDA) and os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu, id="gpu")] + ([pytest.param("cpu", id="interp")] if INTERP else [])
BS, SCRATCH_ID, SCRATCH_ROW = 4, 10_000, 20_000


def _case(seed: int, num_seqs: int, hkv: int, shared: bool, decode: bool, k: int = 6, width: int = 12):
    """A selection ``[seqs, kv_heads, k]`` (ascending, -1 padded; the shared form as a stride-0 view),
    block tables, KV lengths (0 included), and the phase's new tokens."""
    rng = random.Random(seed)
    tables = torch.tensor([rng.sample(range(500), width) for _ in range(num_seqs)], dtype=torch.int32)
    lens, q_lens, positions = [], [], []
    for s in range(num_seqs):
        n = 0 if (s == 1 and not decode) else rng.randrange(1, width * BS + 1)
        lens.append(n)
        if decode:  # one token per sequence: the last of its history
            q_lens.append(1)
            positions.append(n - 1)
        else:  # a chunk after its history (its tokens past the blocks the selection can name)
            q = rng.randrange(0, 6)
            q_lens.append(q)
            positions += [n + i for i in range(q)]

    def pick(n):
        blocks = -(-n // BS)
        chosen = sorted(rng.sample(range(blocks), min(rng.randrange(0, k + 1), blocks)))
        return chosen + [-1] * (k - len(chosen))

    if shared:
        sel = torch.tensor([pick(n) for n in lens], dtype=torch.int32)[:, None, :].expand(-1, hkv, -1)
    else:
        sel = torch.tensor([[pick(n) for _ in range(hkv)] for n in lens], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return sel, tables, torch.tensor(lens, dtype=torch.int32), cu, torch.tensor(positions, dtype=torch.long)


CASES = [(seed, s, h, shared, decode) for seed, (s, h, shared, decode) in enumerate(
    [(1, 1, False, True), (3, 2, False, True), (3, 2, True, True), (4, 4, False, False), (2, 1, True, False)]
)]


@pytest.mark.parametrize("seed,num_seqs,hkv,shared,decode", CASES)
@pytest.mark.parametrize("first,width", [(0, 6), (0, 4), (4, 2), (2, 3)])
def test_selected_piece_reference_is_the_loop(seed, num_seqs, hkv, shared, decode, first, width):
    sel, tables, lens, cu, positions = _case(seed, num_seqs, hkv, shared, decode)
    ids, selection, piece_lens, rows = selected_piece_reference(
        sel, tables, lens, cu, positions, first, width, BS, SCRATCH_ID, SCRATCH_ROW
    )
    assert (ids.dtype, selection.dtype, piece_lens.dtype, rows.dtype) == (torch.int64, torch.int32, torch.int32,
                                                                          torch.int64)
    assert rows.shape == (hkv, positions.shape[0])
    for h in range(hkv):
        for s in range(num_seqs):
            r = h * num_seqs + s
            part = [int(b) for b in sel[s, h, first : first + width]]
            chosen = [b for b in part if b >= 0]
            assert ids[r * width : (r + 1) * width].tolist() == (
                [int(tables[s, b]) * hkv + h for b in chosen] + [SCRATCH_ID] * (width - len(chosen))
            )
            assert selection[r].tolist() == list(range(len(chosen))) + [-1] * (width - len(chosen))
            n = int(lens[s])
            assert int(piece_lens[r]) == sum(min(BS, n - b * BS) for b in chosen)  # tokens of the history in them
            for t in range(int(cu[s]), int(cu[s + 1])):
                p = int(positions[t])
                want = (r * width + part.index(p // BS)) * BS + p % BS if p // BS in chosen else SCRATCH_ROW
                assert int(rows[h, t]) == want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,num_seqs,hkv,shared,decode", CASES)
def test_selected_piece_kernel_is_the_reference(device, seed, num_seqs, hkv, shared, decode):
    from nanovllm.kv import offload_kernels

    case = _case(seed, num_seqs, hkv, shared, decode)
    for first, width in [(0, 6), (4, 2), (2, 3)]:
        want = selected_piece_reference(*case, first, width, BS, SCRATCH_ID, SCRATCH_ROW)
        on = [x.to(device) for x in case]
        on[0] = on[0][:, :1].expand(-1, hkv, -1) if shared else on[0]  # the shared form stays a stride-0 view
        got = offload_kernels.selected_piece(*on, first, width, BS, SCRATCH_ID, SCRATCH_ROW)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w)


def _decode_steps(seed: int, num_seqs: int, hkv: int, k: int, steps: int = 8, width: int = 12):
    """Consecutive decode steps of the same sequences, as a selecting policy makes them: per KV head up to
    ``k`` blocks (ascending, -1 padded), the newest always, about two thirds of the others kept from the step
    before; each step adds a token. Yields (sel, tables, lens, cu, positions)."""
    rng = random.Random(seed)
    tables = torch.tensor([rng.sample(range(500), width) for _ in range(num_seqs)], dtype=torch.int32)
    lens = [rng.randrange(BS, (width - 2) * BS) for _ in range(num_seqs)]
    before: dict[tuple[int, int], list[int]] = {}
    for _ in range(steps):
        rows = []
        for s, n in enumerate(lens):
            newest = (n - 1) // BS
            for h in range(hkv):
                kept = [b for b in before.get((s, h), []) if b != newest and rng.random() < 0.67]
                others = [b for b in range(newest) if b not in kept]
                rng.shuffle(others)
                chosen = sorted(set((kept + others)[: rng.randrange(0, k)]) | {newest})
                before[(s, h)] = chosen
                rows.append(chosen + [-1] * (k - len(chosen)))
        sel = torch.tensor(rows, dtype=torch.int32).view(num_seqs, hkv, k)
        cu = torch.arange(num_seqs + 1, dtype=torch.int32)
        yield sel, tables, torch.tensor(lens, dtype=torch.int32), cu, torch.tensor(lens, dtype=torch.long) - 1
        lens = [n + 1 for n in lens]


def _pool(hkv: int, head_dim: int = 2) -> torch.Tensor:
    """Two layers' pools of 500 blocks (and a scratch block) as head blocks, whose values name them:
    element 0 of head block ``x`` is ``x``."""
    pool = torch.rand(2 * 501 * hkv, 2, BS, head_dim)
    pool[:, 0, 0, 0] = torch.arange(2 * 501 * hkv, dtype=torch.float32)
    return pool


CACHE_CASES = [(0, 1, 2, 4, 0), (1, 3, 2, 6, 501), (2, 2, 4, 5, 501)]  # seed, seqs, kv heads, k, first block


@pytest.mark.parametrize("seed,num_seqs,hkv,k,first_block", CACHE_CASES)
def test_cached_piece_reads_the_selection_and_loads_only_what_its_region_lacks(seed, num_seqs, hkv, k, first_block):
    """Over consecutive steps: attention reads exactly the selected head blocks, each at its own position
    of its row's region; a block selected the step before (not then the newest) is not loaded again; every
    block the cache says it holds is really there; the newest block is loaded every step and never kept;
    selection, lengths and new-token rows are the ring's (``selected_piece_reference``)."""
    pool, base = _pool(hkv), 3
    flat = torch.zeros(base + (num_seqs + 1) * hkv * k + 1, 2, BS, 2)
    scratch_row = (flat.shape[0] - 1) * BS
    # the flat head blocks' pool head blocks: the region, and one more sequence's rows after it, left alone
    held_all = torch.full((flat.shape[0] - 1,), -1, dtype=torch.int32)
    cached = held_all[base : base + num_seqs * hkv * k].view(-1, k)
    before: dict[int, set[int]] = {}
    for sel, tables, lens, cu, positions in _decode_steps(seed, num_seqs, hkv, k):
        counts = torch.zeros(2, dtype=torch.int64)
        loads, tables_v, selection, lens_v, rows = cached_piece_reference(
            sel, tables, lens, cu, positions, cached, base, first_block, BS, scratch_row, counts)
        load_misses(pool, flat, loads, base)
        assert counts.tolist() == [int((loads >= 0).sum()), int((sel >= 0).sum() - (loads >= 0).sum())]
        ring = selected_piece_reference(sel, tables, lens, cu, positions, 0, k, BS, SCRATCH_ID, SCRATCH_ROW)
        assert torch.equal(selection, ring[1]) and torch.equal(lens_v, ring[2])
        assert (held_all[: base] == -1).all() and (held_all[base + num_seqs * hkv * k :] == -1).all()
        for s in range(num_seqs):
            newest = (int(lens[s]) - 1) // BS
            for h in range(hkv):
                c, r = s * hkv + h, h * num_seqs + s
                chosen = [int(b) for b in sel[s, h] if b >= 0]
                wanted = [(first_block + int(tables[s, b])) * hkv + h for b in chosen]
                at = tables_v[r, : len(chosen)]
                assert len(set(at.tolist())) == len(chosen)
                assert ((at >= base + c * k) & (at < base + (c + 1) * k)).all()
                assert flat[at.long(), 0, 0, 0].tolist() == wanted  # attention reads the selection
                loaded = {int(x) for x in loads[c * k : (c + 1) * k] if x >= 0}
                newest_id = (first_block + int(tables[s, newest])) * hkv + h
                assert loaded <= set(wanted) and newest_id in loaded
                assert not loaded & before.get(c, set())  # held since the step before
                held = cached[c]
                where = torch.nonzero(held >= 0).flatten()
                assert (flat[base + c * k + where, 0, 0, 0] == held[where]).all()
                assert newest_id not in held.tolist()
                before[c] = {w for b, w in zip(chosen, wanted, strict=True) if b != newest}
            for t in range(int(cu[s]), int(cu[s + 1])):
                for h in range(hkv):
                    r = h * num_seqs + s
                    i = int(ring[3][h, t]) // BS - r * k  # the token's block among the selection
                    assert int(rows[h, t]) == int(tables_v[r, i]) * BS + int(positions[t]) % BS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,num_seqs,hkv,k,first_block", CACHE_CASES)
def test_cached_piece_kernel_is_the_reference(device, seed, num_seqs, hkv, k, first_block):
    """Step after step, the kernel's outputs and the cache it leaves are the reference's, and
    ``load_misses`` copies what the reference copies."""
    from nanovllm.kv import offload_kernels

    pool, base = _pool(hkv), 3
    want_cached = torch.full((num_seqs * hkv, k), -1, dtype=torch.int32)
    got_cached = want_cached.clone().to(device)
    want_flat = torch.zeros(base + num_seqs * hkv * k + 1, 2, BS, 2)
    got_flat, got_pool = want_flat.clone().to(device), pool.to(device)
    want_counts = torch.zeros(2, dtype=torch.int64)
    got_counts = want_counts.to(device)
    for case in _decode_steps(seed, num_seqs, hkv, k):
        want = cached_piece_reference(*case, want_cached, base, first_block, BS, SCRATCH_ROW, want_counts)
        got = offload_kernels.cached_piece(*(x.to(device) for x in case), got_cached, base, first_block, BS,
                                           SCRATCH_ROW, got_counts)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w)
        assert torch.equal(got_cached.cpu(), want_cached) and torch.equal(got_counts.cpu(), want_counts)
        load_misses(pool, want_flat, want[0], base)
        offload_kernels.load_misses(got_pool, got_flat, got[0], base)
        assert torch.equal(got_flat.cpu(), want_flat)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patch_slot_kernel_is_the_reference(device, dtype):
    from nanovllm.kv import offload_kernels

    gen = torch.Generator().manual_seed(0)
    capacity, hkv, tokens, head_dim = 6, 2, 5, 16
    slot = torch.randn(capacity + 1, 2, BS, head_dim, generator=gen).to(dtype)
    scratch = capacity * BS
    # distinct rows, some tokens not in the piece (scratch)
    rows = torch.randperm(capacity * BS, generator=gen)[: hkv * tokens].view(hkv, tokens)
    rows[0, 1] = rows[1, 3] = scratch
    # in the model's dtype, as the layer gives them: keys contiguous, values a strided view
    qkv = torch.randn(tokens, 3 * hkv, head_dim, generator=gen).to(dtype)
    keys, values = qkv[:, :hkv].contiguous(), qkv[:, 2 * hkv :]
    want = slot.clone()
    patch_slot_reference(want, rows, keys, values)
    got = slot.clone().to(device)
    offload_kernels.patch_slot(got, rows.to(device), keys.to(device), values.to(device))
    assert torch.equal(got[:capacity].cpu(), want[:capacity])  # the scratch block takes any of its writes
    assert not torch.equal(want[:capacity], slot[:capacity])


@pytest.mark.skipif(CUDA or INTERP, reason="CUDA runs the gpu cases; the subprocess, the interp cases")
def test_offload_kernels_under_interpreter():
    from nanovllm.testing import run_under_interpreter

    returncode, tail, passed = run_under_interpreter(__file__)
    assert returncode == 0, tail
    assert passed == len(CASES) + len(CACHE_CASES) + 2, tail
