"""``python benchmarks/xattn_quality.py``: XAttention's quality on the real SmolLM2-135M-Instruct over long
natural English text found on this machine, next to dense, the oracle blocks and random blocks.

The harness is the core's (:mod:`nanovllm.quality.prefill`): each chunk's blocks are selected from its own
estimate over every key so far, and for a sample of query rows the blocks each KV head reads are compared
with dense attention (:func:`nanovllm.quality.metrics.compare_selection`): attention-mass recall, top-k
recall, output error and density, with the oracle (as many blocks, those with the most true mass) and random
blocks. Per query head selections (``head_reduce=none``) are compared key by key (``compare_key_masks``).
Then the perplexity of the text's last part with XAttention prefill in the engine, against dense.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from nanovllm.quality.prefill import results_table

DEFAULT_SETTINGS = ["threshold=0.9", "threshold=0.9,head_reduce=\"union\"", "threshold=0.9,head_reduce=\"majority\"",
                    "threshold=0.9,head_reduce=\"none\"", "threshold=0.9,head_reduce=\"global_majority\"",
                    "threshold=0.8", "threshold=0.95", "threshold=0.9,stride=16", "ratio=0.2"]


def measure(policy, q: torch.Tensor, ctx, positions: torch.Tensor, dense) -> tuple[dict[str, Any], float]:
    """The policy's blocks for the query rows at ``positions`` against dense attention, and the chunk's
    block density."""
    from nanovllm.quality.metrics import compare_key_masks, compare_selection

    from nanovllm_xattn.layout import first_query_blocks
    from nanovllm_xattn.policy import _ops, chunk_slices
    from nanovllm_xattn.selection import causal_density

    meta, block = ctx.meta, policy.config.block_size
    (part,) = chunk_slices(meta.cu_seqlens_q, meta.context_lens, meta.max_query_len, block, meta.max_query_len)
    mask = policy.select(q, ctx, part, ctx.k_cache, meta.block_tables, _ops(q.device)[0])[0]  # [Hs, R, N]
    density = causal_density(mask[None], meta.cu_seqlens_q, meta.context_lens, block)
    first = int(first_query_blocks(meta.cu_seqlens_q, meta.context_lens, block))
    row_mask = mask[:, positions // block - first, :].transpose(0, 1)  # [Q, Hs, N]
    if row_mask.shape[1] == dense.num_kv_heads:
        cols = torch.arange(row_mask.shape[-1], dtype=torch.int32)
        listed = torch.where(row_mask, cols, -1).sort(-1, descending=True).values
        selection = listed[..., : max(int(row_mask.sum(-1).max()), 1)]
        return compare_selection(dense, selection, block), density
    keys = row_mask.repeat_interleave(block, dim=-1)[..., : dense.num_keys]  # per query head: as a key mask
    return compare_key_masks(dense, keys & dense.visible()[:, None, :]), density


def markdown(payload: dict[str, Any]) -> str:
    env = payload["environment"]
    lines = [
        "# nanovllm-xattn quality on SmolLM2-135M-Instruct", "",
        f"{env['date']}, commit {env['commit']}, CPU (torch references). Text: {payload['text']['name']} "
        f"({payload['tokens']} tokens), prefill chunks of {payload['chunk']}, blocks of 128 unless the setting says "
        f"otherwise, layers {payload['layers']}, {payload['rows_per_chunk']} query rows sampled per chunk after the "
        f"first. Perplexity of the last {payload['ppl_tail']} tokens, dense {payload['dense_perplexity']:.3f}.", "",
        "Density: the share of visible keys the selection reads (mean over rows and heads); block density: kept "
        "blocks over causal blocks of the whole chunk. Oracle and random read as many blocks per row and KV head "
        "(per query head and key for `head_reduce=\"none\"`).", "",
        *results_table(payload["results"], "block density")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from nanovllm.quality import prefill

    from nanovllm_xattn.config import XAttentionConfig
    from nanovllm_xattn.policy import XAttentionPolicy

    def run(args, done):
        def make_policy(options):
            return XAttentionPolicy(XAttentionConfig(**options))

        settings = [s if "block_size=" in s else f"{s},block_size={args.block_size}" for s in args.settings]
        return prefill.run("xattn", settings, make_policy, measure, args.tokens, args.chunk, args.layers,
                           args.rows_per_chunk, args.ppl_tail, fixed={"dense_below": 0}, done=done)

    return prefill.main(argv, "python benchmarks/xattn_quality.py", __doc__.split("\n")[0], DEFAULT_SETTINGS,
                        "xattn_quality", run, markdown,
                        lambda parser: parser.add_argument("--block-size", type=int, default=128))


if __name__ == "__main__":
    sys.exit(main())
