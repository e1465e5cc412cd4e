"""Outputs one a step, merged as the front-end merges the steps it applies before a request's consumer runs:
for tests that compare ``AsyncLLM``'s outputs (their number depends on timing) with the step API's."""

from __future__ import annotations

import attrs
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind


def merge(a: RequestOutput, b: RequestOutput, kind: RequestOutputKind) -> RequestOutput:
    """Two successive outputs of a request as one: DELTA's completions concatenated (text, tokens, logprobs;
    the rest the later one's), otherwise the later one."""
    if kind != RequestOutputKind.DELTA:
        return b
    completions = {c.index: c for c in a.outputs}
    for c in b.outputs:
        if (before := completions.get(c.index)) is not None:
            c = attrs.evolve(c, text=before.text + c.text, token_ids=before.token_ids + c.token_ids,
                             logprobs=None if c.logprobs is None else before.logprobs + c.logprobs)
        completions[c.index] = c
    return attrs.evolve(b, outputs=[completions[i] for i in sorted(completions)])


def progress(outputs: list[RequestOutput], kind: RequestOutputKind) -> list[tuple]:
    """After each output: per completion, the tokens returned so far and whether it finished."""
    tokens: dict[int, int] = {}
    finished: dict[int, bool] = {}
    after = []
    for out in outputs:
        for c in out.outputs:
            tokens[c.index] = tokens.get(c.index, 0) + len(c.token_ids) if kind == RequestOutputKind.DELTA \
                else len(c.token_ids)
            finished[c.index] = c.finish_reason is not None
        after.append(tuple(sorted((i, tokens[i], finished[i]) for i in tokens)))
    return after


def merged_like(outputs: list[RequestOutput], per_step: list[RequestOutput],
                kind: RequestOutputKind) -> list[RequestOutput]:
    """``per_step`` merged into runs of successive outputs, each ending where ``outputs`` has one (at the same
    progress), so that ``outputs`` equals it if it is ``per_step`` merged (and differs if not)."""
    targets = progress(outputs, kind)
    merged, run = [], None
    for out, reached in zip(per_step, progress(per_step, kind), strict=True):
        run = out if run is None else merge(run, out, kind)
        if len(merged) < len(targets) and reached == targets[len(merged)]:
            merged.append(run)
            run = None
    return merged if run is None else [*merged, run]
