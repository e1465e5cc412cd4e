"""Greedy generation on a tensor-parallel world that torchrun started, on one host or several.

    torchrun --nproc-per-node 4 examples/torchrun_generate.py llama-3.1-70b
    scripts/torchrun_nodes.sh 2 2 examples/torchrun_generate.py MODEL --out DIR   # two nodes on one host

Every rank runs this script: the world has torchrun's ``WORLD_SIZE`` ranks, each takes the GPU of its
``LOCAL_RANK``, rank 0 schedules and the others follow. Prompts are token ids (a shape preset has no
tokenizer). Rank 0 prints the tokens; with ``--out``, every rank writes them to ``DIR/rank{RANK}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from nanovllm import LLM, SamplingParams

DEFAULT_PROMPTS = [[5, 6, 7], list(range(10, 40)), list(range(50, 61)), list(range(100, 170))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a preset, a model directory or a hub ID")
    parser.add_argument("--prompts", type=json.loads, default=DEFAULT_PROMPTS, help="JSON lists of token ids")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engine", type=json.loads, default={},
                        help='more engine options as JSON, e.g. \'{"dtype": "float32", "enforce_eager": true}\'')
    parser.add_argument("--out", type=Path, help="folder for each rank's rank{RANK}.json")
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun sets it; the engine checks the rest
    with LLM(args.model, tensor_parallel_size=world_size, distributed_executor_backend="external_launcher",
             **args.engine) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(args.prompts, greedy, use_tqdm=False)]
    rank = int(os.environ.get("RANK", "0"))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps({"world_size": world_size, "tokens": tokens}))
    if rank == 0:
        print(json.dumps(tokens), flush=True)


if __name__ == "__main__":
    main()
