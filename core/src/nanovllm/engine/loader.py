"""Model directories: checks with clear errors, and safetensors loading into packed parameters.

Each checkpoint tensor reaches its parameter's ``weight_loader`` as a :class:`LazyTensor`, so that a
tensor-parallel rank reads only its own shard of a sharded weight from the file, never the whole tensor."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.layers.linear import default_weight_loader


class ModelDirectoryError(ValueError):
    """The model directory is missing, incomplete or malformed."""


def read_config_json(path: Path) -> dict:
    if not path.is_dir():
        raise ModelDirectoryError(f"model directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelDirectoryError(
            f"{str(path)!r} has no config.json; nanovllm loads Hugging Face-format directories "
            "(config.json, *.safetensors, tokenizer files)"
        )
    try:
        data = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ModelDirectoryError(f"{config_file} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelDirectoryError(f"{config_file} must hold a JSON object")
    return data


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: the shards an index names, else every ``*.safetensors`` file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelDirectoryError(f"{index} is malformed: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelDirectoryError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelDirectoryError(f"{str(path)!r} has no *.safetensors weight files")
    return files


class LazyTensor:
    """A checkpoint tensor not read yet: ``shape`` as a tensor's, and ``lazy[index]`` reads just the indexed
    part from the file (``lazy[...]`` reads it all)."""

    def __init__(self, part) -> None:  # safetensors' slice of one tensor
        self._part = part
        self.shape = torch.Size(part.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self._part[index]


def load_weights(model: nn.Module, path: Path) -> None:
    """Copy every checkpoint tensor of the safetensors files in ``path`` into ``model``."""

    def tensors():
        for file in safetensors_files(path):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, file.name, LazyTensor(f.get_slice(name))

    load_tensors(model, tensors(), f"checkpoint in {str(path)!r}")


@torch.no_grad()
def load_tensors(model: nn.Module, tensors: Iterable[tuple[str, str, Any]], source: str) -> None:
    """Copy each ``(checkpoint name, where it is, tensor or lazy tensor)`` into ``model``; packed projections
    take their shard via the model's ``packed_modules_mapping`` (checkpoint name -> (parameter name, shard
    id)). ``source`` names the checkpoint in the error about weights it lacks."""
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, where, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        target, shard = name, None
        for ckpt_key, (packed_name, shard_id) in packed.items():
            if f".{ckpt_key}." in name:
                target, shard = name.replace(f".{ckpt_key}.", f".{packed_name}."), shard_id
                break
        param = params.get(target)
        if param is None:
            if name == "lm_head.weight":  # tied embeddings: the embedding already holds it
                continue
            raise ModelDirectoryError(f"checkpoint tensor {name!r} in {where} has no place in the model")
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor) if shard is None else loader(param, tensor, shard)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelDirectoryError(f"{source} lacks weights for: {', '.join(missing[:8])}")
