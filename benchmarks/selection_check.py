"""CPU cost of the engine's check of one ``select_blocks`` result (``nanovllm.policy.check_selection``), per
layer call, beside the decode attention over the same selection with the ``torch`` backend.

    python benchmarks/selection_check.py

Shapes: SmolLM2-135M's heads (9 query, 3 KV, head size 64), blocks of 16 tokens, a per-KV-head selection of
``k`` blocks (Quest's form); one thread, the best of several rounds.
"""

from __future__ import annotations

import time

import torch
from nanovllm.attention.metadata import PhaseMetadata
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.policy import PolicyContext, check_selection
from nanovllm.sparse import SparsePolicy

BLOCK, HEADS, KV_HEADS, DIM = 16, 9, 3, 64


def decode_context(num_seqs: int, context: int) -> PolicyContext:
    width = context // BLOCK
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    tables = torch.arange(num_seqs * width, dtype=torch.int32).view(num_seqs, width)
    meta = PhaseMetadata(torch.arange(num_seqs + 1, dtype=torch.int32), lens, tables, 1, context)
    cache = torch.randn(num_seqs * width, BLOCK, KV_HEADS, DIM)
    return PolicyContext(0, False, torch.randn(num_seqs, HEADS, DIM), meta, cache, cache, DIM**-0.5,
                         TorchBackend())


def best_us(fn, repeat: int = 200, rounds: int = 5) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        times.append((time.perf_counter() - start) / repeat * 1e6)
    return min(times)


def main() -> None:
    torch.set_num_threads(1)
    policy = SparsePolicy()
    print(f"{'seqs':>4} {'context':>7} {'k':>4}  {'check us':>8}  {'attention us':>12}  share")
    for num_seqs, context, k in [(1, 2048, 16), (8, 2048, 16), (8, 32768, 128), (64, 4096, 64)]:
        ctx = decode_context(num_seqs, context)
        n = ctx.num_history_blocks
        step = max(1, context // BLOCK // k)
        blocks = (torch.arange(k, dtype=torch.int32) * step)[None, None, :].expand(num_seqs, KV_HEADS, k)
        blocks = torch.where(blocks < n[:, None, None], blocks, -1).contiguous()
        check = best_us(lambda: check_selection(policy, ctx, blocks))  # noqa: B023
        attend = best_us(lambda: ctx.attend_blocks(ctx.query, blocks), repeat=20)  # noqa: B023
        print(f"{num_seqs:>4} {context:>7} {k:>4}  {check:>8.1f}  {attend:>12.1f}  {check / attend:.1%}")


if __name__ == "__main__":
    main()
