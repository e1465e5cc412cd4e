"""Run by test_tensor_parallel.py under ``torchrun --nproc-per-node 2`` (gloo): each rank builds the given
tiny models on its shard and loads them with every read from the checkpoint recorded, then writes, per model,
the parameters that differ from the full checkpoint tensor narrowed here by hand, and the elements it read
against the elements its parameters hold. The same again with random weights (``load_format="dummy"``):
there the "checkpoint" is the random one made whole, and a read is what a rank made of it.

Usage: tp_shard_check.py OUT_DIR ARCH=MODEL_DIR [ARCH=MODEL_DIR ...]; results per ARCH and "ARCH random".
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nanovllm.engine.loader as loader
import torch
from nanovllm.engine.model_loading import RandomTensor, random_checkpoint
from nanovllm.distributed import destroy_tensor_parallel, init_tensor_parallel, tp_rank, tp_size
from nanovllm.plugins import get_plugins, load_registered
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig


class RecordingSlice:
    def __init__(self, part, reads: list[int]) -> None:
        self.part, self.reads = part, reads

    def get_shape(self):
        return self.part.get_shape()

    def __getitem__(self, index):
        tensor = self.part[index]
        self.reads.append(tensor.numel())
        return tensor


class RecordingFile:
    """A safetensors file whose slices count the elements read; reading a whole tensor is an error."""

    def __init__(self, path: str, framework: str, reads: dict[str, list[int]]) -> None:
        self.file, self.reads = safe_open(path, framework=framework), reads

    def __enter__(self):
        self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def keys(self):
        return self.file.keys()

    def get_tensor(self, name: str):
        raise AssertionError(f"the loader read {name} whole")

    def get_slice(self, name: str) -> RecordingSlice:
        return RecordingSlice(self.file.get_slice(name), self.reads.setdefault(name, []))


def expected(checkpoint: dict[str, torch.Tensor], name: str, vocab_size: int) -> torch.Tensor:
    """Rank ``tp_rank()``'s part of parameter ``name``, cut from the full checkpoint tensors."""
    rank, world = tp_rank(), tp_size()

    def part(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return tensor.chunk(world, dim)[rank]

    packing = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for packed, sources in packing.items():
        if f".{packed}." in name:
            return torch.cat([part(checkpoint[name.replace(packed, source)]) for source in sources])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return part(checkpoint[name], 1)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        full = checkpoint.get(name, checkpoint["model.embed_tokens.weight"])
        per_rank = -(-vocab_size // world)
        rows = full[rank * per_rank : (rank + 1) * per_rank]
        return torch.cat([rows, rows.new_zeros(per_rank - rows.shape[0], rows.shape[1])])
    return checkpoint[name]  # replicated: norms, and the biases of row-parallel layers


def check(architecture: str, path: Path, random: bool) -> dict:
    hf_config = AutoConfig.from_pretrained(path)
    family = get_plugins().registry.model_families[architecture]
    model = load_registered(family.target, family.dist, architecture)(hf_config)
    reads: dict[str, list[int]] = {}
    if random:
        tensors = random_checkpoint(hf_config, architecture, torch.float32, torch.device("cpu"))
        checkpoint = {name: tensor[...] for name, _, tensor in tensors}  # whole: only here, to compare with
        make = RandomTensor.__getitem__

        def recorded(tensor: RandomTensor, index) -> torch.Tensor:
            part = make(tensor, index)
            reads.setdefault(tensor.name, []).append(part.numel())
            return part

        RandomTensor.__getitem__ = recorded
        try:
            loader.load_tensors(model, tensors, "random")
        finally:
            RandomTensor.__getitem__ = make
    else:
        original = loader.safe_open
        loader.safe_open = lambda file, framework: RecordingFile(file, framework, reads)
        try:
            loader.load_weights(model, path)
        finally:
            loader.safe_open = original
        checkpoint = load_file(path / "model.safetensors")
    params = dict(model.named_parameters())
    vocab = hf_config.vocab_size
    padding = params["model.embed_tokens.weight"].shape[0] * tp_size() - vocab  # zero rows of the last rank
    held = sum(p.numel() for p in params.values())
    if tp_rank() == tp_size() - 1:
        held -= padding * hf_config.hidden_size * (1 if hf_config.tie_word_embeddings else 2)
    return {
        "differ": [n for n, p in params.items() if not torch.equal(p, expected(checkpoint, n, vocab))],
        "read": sum(sum(r) for r in reads.values()),
        "held": held,
        "checkpoint": sum(t.numel() for name, t in checkpoint.items() if name in reads),
        "reads_per_tensor": sorted({len(r) for r in reads.values()}),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    init_tensor_parallel(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "cpu")
    try:
        out = Path(sys.argv[1])
        models = [a.split("=", 1) for a in sys.argv[2:]]
        results = {f"{arch}{' random' * random}": check(arch, Path(path), random)
                   for arch, path in models for random in (False, True)}
        (out / f"rank{tp_rank()}.json").write_text(json.dumps(results))
    finally:
        destroy_tensor_parallel()
