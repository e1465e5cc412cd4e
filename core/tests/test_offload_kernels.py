"""The offload engine's per-piece Triton kernels against their torch references (exact: integers and
copies), on CUDA (``gpu``) and at small sizes under Triton's interpreter in a subprocess on machines
without CUDA; and the references against a plain loop over every virtual sequence and token."""

from __future__ import annotations

import os
import random

import pytest
import torch
from nanovllm.engine.offload import patch_slot_reference, selected_piece_reference

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
    from nanovllm.engine import offload_kernels

    case = _case(seed, num_seqs, hkv, shared, decode)
    for first, width in [(0, 6), (4, 2), (2, 3)]:
        want = selected_piece_reference(*case, first, width, BS, SCRATCH_ID, SCRATCH_ROW)
        on = [x.to(device) for x in case]
        on[0] = on[0][:, :1].expand(-1, hkv, -1) if shared else on[0]  # the shared form stays a stride-0 view
        got = offload_kernels.selected_piece(*on, first, width, BS, SCRATCH_ID, SCRATCH_ROW)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patch_slot_kernel_is_the_reference(device, dtype):
    from nanovllm.engine import offload_kernels

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
    assert passed == len(CASES) + 2, tail
