"""``python benchmarks/quest_select_modes.py``: Quest's selection per layer in each mode (``group_reduction``
max or mass, ``rescore`` 1 or 2) on llama-3.1-8b shapes (32 query heads, 8 KV heads, head size 128,
bfloat16, blocks of 16, float8 bounds where the GPU has them), next to dense decode attention.

Each row times the policy's own ``select_blocks`` (scoring and top-K, and with rescore the nominees' keys
rescored and the budget picked), and ``compute_chunked_decode`` (the selection and the attention over it),
with layers of distinct KV captured one after another in one CUDA graph, as in the engine's decode graph;
times are per layer. ``vs_bound`` is the selection's time over that of ``max`` without rescore (the
paper's: scoring and top-K alone).

    python benchmarks/quest_select_modes.py --contexts 32768 --batches 1 8

With ``TRITON_INTERPRET=1`` on a machine without CUDA it runs once under Triton's interpreter, on small
sizes (e.g. ``--contexts 1024 --budget 128 --layers 2``), which checks this code, not the speed.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

MODES = [("max", 1), ("mass", 1), ("max", 2), ("mass", 2)]
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def layer_contexts(context: int, batch: int, layers: int, device):
    """One decode step's policy contexts of ``layers`` layers, each with its own random paged KV cache of
    ``batch`` sequences of ``context`` tokens in shuffled blocks."""
    import torch
    from nanovllm.attention.metadata import PhaseMetadata
    from nanovllm.attention.triton_backend import TritonBackend
    from nanovllm.sparse import PolicyContext

    gen = torch.Generator(device=device).manual_seed(0)
    width = context // BLOCK_SIZE
    contexts = []
    for layer in range(layers):
        shape = (batch * width, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        k_cache = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
        v_cache = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
        tables = torch.randperm(batch * width, generator=gen, device=device).view(batch, width).int()
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
        meta = PhaseMetadata(starts, lens, tables, 1, context)
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
        contexts.append(PolicyContext(layer, False, q, meta, k_cache, v_cache, HEAD_DIM**-0.5,
                                      TritonBackend()))
    return contexts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/quest_select_modes.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", nargs="+", type=int, default=[32768])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--budget", type=int, default=2048, help="token budget")
    parser.add_argument("--layers", type=int, default=8, help="layers of distinct KV in one graph")
    args = parser.parse_args(argv)

    import torch
    from nanovllm.bench.kernels import DEV, DRY, graph_ms
    from nanovllm.sparse import KVWrite
    from nanovllm_quest.config import QuestConfig
    from nanovllm_quest.policy import QuestPolicy

    from nanovllm_quest import kernels

    device = torch.device(DEV)
    print("| context | batch | group_reduction | rescore | select us | select + attend us | dense us "
          "| vs_bound |")
    print("|---|---|---|---|---|---|---|---|")
    for context in args.contexts:
        for batch in args.batches:
            ctxs = layer_contexts(context, batch, args.layers, device)
            dense_us = 1000 * graph_ms([partial(c.backend.decode, c.query, c.k_cache, c.v_cache, c.meta,
                                                c.scale) for c in ctxs])
            metadata, bound_us = None, None
            for reduction, rescore in MODES:
                policy = QuestPolicy(QuestConfig(token_budget=args.budget, skip_layers=0,
                                                 group_reduction=reduction, rescore=rescore))
                policy.initialize(len(ctxs), KV_HEADS, HEAD_DIM, ctxs[0].k_cache.shape[0], BLOCK_SIZE,
                                  torch.bfloat16, device)
                policy.ops = kernels  # under the interpreter too
                if metadata is None:  # the bounds do not depend on the mode: kept once, shared
                    for c in ctxs:
                        for s in range(batch):
                            policy.on_kv_write(KVWrite.of_sequence(c.layer_id, c.k_cache, c.v_cache,
                                                                   c.meta.block_tables[s].tolist(), context))
                    metadata = policy.metadata
                policy.metadata = metadata
                select_us = 1000 * graph_ms([partial(policy.select_blocks, c) for c in ctxs])
                both_us = 1000 * graph_ms([partial(policy.compute_chunked_decode, c.query, c) for c in ctxs])
                bound_us = bound_us or select_us
                print(f"| {context} | {batch} | {reduction} | {rescore} | {select_us:.1f} | {both_us:.1f} | "
                      f"{dense_us:.1f} | {select_us / bound_us:.2f} |", flush=True)
            del ctxs, metadata
            if not DRY:
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
