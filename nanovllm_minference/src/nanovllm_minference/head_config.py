"""Per-head patterns from a JSON file in the format of MInference's published model configs.

The file is a list with one object per layer; each maps a query head (its index, as a string) to
``[pattern, vertical_size, slash_size, score]``. MInference's pattern names map to this policy's:
``vertical_and_slash`` (columns and diagonals), ``stream_llm`` (A-shape: ``vertical_size`` first keys and
``slash_size`` nearest diagonals) and ``block_sparse`` (``vertical_size`` key tiles per query tile). A head
the file omits gets ``vertical_and_slash`` with (1000, 6096), as in MInference.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

PATTERN_NAMES = {"vertical_and_slash": "vertical_slash", "stream_llm": "a_shape", "block_sparse": "block_sparse"}
DEFAULT_HEAD = ("vertical_slash", 1000, 6096)


@attrs.frozen
class HeadPattern:
    pattern: str  # one of config.PATTERNS
    vertical_size: int  # a_shape: n_init; block_sparse: key tiles per query tile
    slash_size: int  # a_shape: n_local


def _head(path: Path, layer: int, head: str, entry: object) -> HeadPattern:
    where = f"{path}: layer {layer}, head {head}"
    if not (isinstance(entry, list) and len(entry) >= 3):
        raise ValueError(f"{where}: expected [pattern, vertical_size, slash_size, score], got {entry!r}")
    name, vertical, slash = entry[:3]
    if name not in PATTERN_NAMES:
        raise ValueError(f"{where}: unknown pattern {name!r}; MInference's names are {', '.join(PATTERN_NAMES)}")
    for what, value in (("vertical_size", vertical), ("slash_size", slash)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {what} must be a positive int, got {value!r}")
    return HeadPattern(PATTERN_NAMES[name], vertical, slash)


def load_head_patterns(path: str | Path) -> list[dict[int, HeadPattern]]:
    """Per layer, the heads the file names; checked now, so a bad file fails when the engine starts."""
    path = Path(path)
    try:
        layers = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config_path {str(path)!r} does not exist; give the path of an MInference per-head "
                         "pattern JSON file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"config_path {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
        raise ValueError(f"{path}: expected a list with one {{head: [pattern, vertical, slash, score]}} per layer")
    out = []
    for i, layer in enumerate(layers):
        heads = {}
        for head, entry in layer.items():
            if not str(head).isdigit():
                raise ValueError(f"{path}: layer {i}: head keys are head indices, got {head!r}")
            heads[int(head)] = _head(path, i, head, entry)
        out.append(heads)
    return out


def layer_heads(layers: list[dict[int, HeadPattern]], layer_id: int, num_heads: int) -> list[HeadPattern]:
    """Every query head's pattern in one layer, the omitted ones the default."""
    heads = layers[layer_id]
    extra = [h for h in heads if h >= num_heads]
    if extra:
        raise ValueError(f"the per-head pattern file names head {extra[0]} of layer {layer_id}, but the model has "
                         f"{num_heads} query heads: is it the config of another model?")
    return [heads.get(h, HeadPattern(*DEFAULT_HEAD)) for h in range(num_heads)]
