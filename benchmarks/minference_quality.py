"""``python benchmarks/minference_quality.py``: MInference's quality on the real SmolLM2-135M-Instruct over long
natural English text found on this machine, next to dense, the oracle and a random pattern.

The harness is the core's (:mod:`nanovllm.quality.prefill`): each
chunk's index is built from its own last queries over every key so far, and the keys it reads for a
sample of query rows are compared with dense attention (:func:`nanovllm.quality.metrics.compare_key_masks`):
attention-mass recall, top-k recall, output error and density, per query head, with the oracle (the
same number of keys, the heaviest) and a random pattern of that size. Then the perplexity of the text's
last part with MInference prefill in the engine, against dense. Runs on the CPU (torch references).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from nanovllm.quality.prefill import results_table

DEFAULT_SETTINGS = ["vertical_size=64,slash_size=256", "vertical_size=128,slash_size=512",
                   "vertical_size=256,slash_size=1024", "vertical_size=500,slash_size=2000",
                   "vertical_size=1000,slash_size=6096", "adaptive_budget=0.1", "adaptive_budget=0.3",
                   'pattern="a_shape",n_init=128,n_local=1024']


def measure(policy, q: torch.Tensor, ctx, positions: torch.Tensor, dense) -> tuple[dict[str, Any], float]:
    """The keys the policy's index reads for the query rows at ``positions`` against dense attention, and
    the chunk's computed density (the kernel's work over dense causal work)."""
    from nanovllm.quality.metrics import compare_key_masks

    from nanovllm_minference.index import computed_density, index_mask
    from nanovllm_minference.policy import _ops

    meta = ctx.meta
    index = policy.build_index(q, ctx, ctx.k_cache, meta.block_tables, _ops(q.device))
    start = int(meta.context_lens[0]) - q.shape[0]
    mask = index_mask(index, meta.cu_seqlens_q, meta.context_lens, positions - start)
    return compare_key_masks(dense, mask), computed_density(index, meta.cu_seqlens_q, meta.context_lens)


def markdown(payload: dict[str, Any]) -> str:
    env = payload["environment"]
    lines = [
        "# nanovllm-minference quality on SmolLM2-135M-Instruct", "",
        f"{env['date']}, commit {env['commit']}, CPU (torch references). Text: {payload['text']['name']} "
        f"({payload['tokens']} tokens), prefill chunks of {payload['chunk']}, layers {payload['layers']}, "
        f"{payload['rows_per_chunk']} query rows sampled per chunk after the first. Perplexity of the last "
        f"{payload['ppl_tail']} tokens, dense {payload['dense_perplexity']:.3f}.", "",
        "Density: the share of visible keys the pattern reads (mean over rows and query heads). Oracle and "
        "random read as many keys per row and head.", "",
        *results_table(payload["results"], "computed density")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from nanovllm.quality import prefill

    from nanovllm_minference.config import MInferenceConfig
    from nanovllm_minference.policy import MInferencePolicy

    def run(args, done):
        def make_policy(options):
            return MInferencePolicy(MInferenceConfig(**options))

        return prefill.run("minference", args.settings, make_policy, measure, args.tokens, args.chunk, args.layers,
                           args.rows_per_chunk, args.ppl_tail, fixed={"dense_below": 0, "dense_above": None},
                           done=done)

    return prefill.main(argv, "python benchmarks/minference_quality.py", __doc__.split("\n")[0], DEFAULT_SETTINGS,
                        "minference_quality", run, markdown)


if __name__ == "__main__":
    sys.exit(main())
