"""The pass-key retrieval test (Mohtashami & Jaggi, 2023): a five-digit key hidden at a chosen depth of
a long filler, then the question; a trial is a hit when the greedy answer's first number is the key.

A prompt is built from token ids, so its length is exact in tokens: the tokenizer's BOS (when it adds
one), an instruction, ``depth`` of the filler, the key's line, the rest of the filler and the question.
The key's line starts at the filler's sentence end nearest ``depth`` (within 64 tokens; else exactly
at ``depth``). Fillers:

- ``classic``: "The grass is green. The sky is blue. ..." repeated (the paper's);
- ``natural``: the start of a long natural text (a file such as ``long_text.txt``).

Keys are drawn from a seed, the filler's name, the length, the depth and the trial number, so every run
(and every engine) sees the same prompts.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

import attrs

CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.\n")
KEY_LINE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
MAX_SNAP = 64  # tokens the key may move to start after a sentence end
DEFAULT_DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@attrs.define(frozen=True)
class PassKeyPrompt:
    """One trial's prompt: ``token_ids`` of exactly ``length`` tokens, the key's line at ``key_position``."""

    filler: str
    length: int
    depth: float
    trial: int
    key: str
    key_position: int  # index of the key line's first token
    token_ids: list[int] = attrs.field(repr=False)

    def describe(self) -> dict[str, Any]:
        return {"filler": self.filler, "length": self.length, "depth": self.depth, "trial": self.trial,
                "key": self.key, "key_position": self.key_position}


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def bos_ids(tokenizer: Any) -> list[int]:
    """The tokens the tokenizer puts before a text (Gemma's, Llama's BOS; none for SmolLM2)."""
    marked = list(tokenizer.encode("x", add_special_tokens=True))
    plain = _encode(tokenizer, "x")
    return marked[: len(marked) - len(plain)] if marked[len(marked) - len(plain):] == plain else []


def classic_filler_ids(tokenizer: Any, num_tokens: int) -> list[int]:
    """At least ``num_tokens`` tokens of the classic filler, repeated."""
    unit = _encode(tokenizer, CLASSIC_FILLER)
    return unit * (num_tokens // len(unit) + 1)


def sentence_ends(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """Positions ``p`` in ``[0, len(ids)]`` where a cut falls right after a sentence end (``.``, ``!``,
    ``?`` or a line break); 0 always counts."""
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    ends = [0]
    for i, piece in enumerate(pieces):
        text = str(piece).replace("Ċ", "\n").rstrip(" ▁Ġ")
        if text.endswith((".", "!", "?", "\n")) or text.endswith("<0x0A>"):
            ends.append(i + 1)
    return ends


def key_for(seed: int, filler: str, length: int, depth: float, trial: int) -> str:
    """A five-digit key (10000-99999) fixed by its arguments."""
    return str(random.Random(f"{seed}:{filler}:{length}:{depth:.4f}:{trial}").randint(10000, 99999))


def build_prompt(tokenizer: Any, filler_ids: Sequence[int], length: int, depth: float, key: str,
                 filler: str = "classic", trial: int = 0, ends: Sequence[int] | None = None) -> PassKeyPrompt:
    """The prompt of exactly ``length`` tokens with ``key`` at ``depth`` (0-1) of the filler;
    ``filler_ids`` must hold at least the filler's share of ``length``, ``ends`` its sentence ends
    (:func:`sentence_ends`; default: computed here)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    head = bos_ids(tokenizer) + _encode(tokenizer, INSTRUCTION)
    needle = _encode(tokenizer, KEY_LINE.format(key=key))
    question = _encode(tokenizer, QUESTION)
    budget = length - len(head) - len(needle) - len(question)
    if budget < 1:
        raise ValueError(f"length {length} leaves no room for filler: the fixed parts take "
                         f"{length - budget} tokens; ask for a longer prompt")
    if len(filler_ids) < budget:
        raise ValueError(f"the {filler} filler has {len(filler_ids)} tokens, fewer than the {budget} a "
                         f"{length}-token prompt needs; give a longer filler text")
    if ends is None:
        ends = sentence_ends(tokenizer, filler_ids[:budget])
    target = round(depth * budget)
    cut = min((e for e in ends if e <= budget), key=lambda e: (abs(e - target), e))
    if abs(cut - target) > MAX_SNAP:  # no sentence end near: cut between tokens
        cut = target
    ids = head + list(filler_ids[:cut]) + needle + list(filler_ids[cut:budget]) + question
    assert len(ids) == length
    return PassKeyPrompt(filler, length, depth, trial, key, len(head) + cut, ids)


def build_prompts(tokenizer: Any, fillers: dict[str, list[int]], lengths: Sequence[int],
                  depths: Sequence[float] = DEFAULT_DEPTHS, trials_per_depth: int = 2,
                  seed: int = 0) -> list[PassKeyPrompt]:
    """Every trial: per filler (name -> token ids), length, depth and trial number, in that order."""
    prompts = []
    for name, ids in fillers.items():
        for length in lengths:
            ends = sentence_ends(tokenizer, ids[:length])
            for depth in depths:
                for trial in range(trials_per_depth):
                    key = key_for(seed, name, length, depth, trial)
                    prompts.append(build_prompt(tokenizer, ids, length, depth, key, name, trial, ends))
    return prompts


def answer_number(answer: str) -> str | None:
    """The first run of digits in ``answer`` (``None``: no digit)."""
    found = re.search(r"\d+", answer)
    return found.group(0) if found else None


def is_hit(answer: str, key: str) -> bool:
    """Exact match: the answer's first number is the key."""
    return answer_number(answer) == key


def accuracy_table(trials: list[dict[str, Any]], hit_field: str = "hit") -> dict[str, dict[int, list[int]]]:
    """``{filler: {length: [hits, trials]}}`` of trial records carrying ``filler``, ``length`` and a
    bool under ``hit_field``."""
    table: dict[str, dict[int, list[int]]] = {}
    for t in trials:
        cell = table.setdefault(t["filler"], {}).setdefault(t["length"], [0, 0])
        cell[0] += bool(t[hit_field])
        cell[1] += 1
    return table
