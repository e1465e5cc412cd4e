"""Perplexity of a text's last part under a sparse policy, next to dense, through the public engine.

The text is one request with ``prompt_logprobs=0``. Its head is prefilled in chunks; its tail is fed in
steps of ``tail_step`` tokens. With ``tail_step=1`` every tail token is a one-token step, which the engine
runs in the decode phase (vLLM's rule), so a decode policy such as Quest decides what each tail token
attends to, exactly as when generating. The density of what the policies selected is measured by an
observer of ``on_blocks_selected``.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from nanovllm.policy import PolicyContext
from nanovllm.utils import progress_bar


class DensityMeter:
    """Observer: tokens the selections cover, against the history tokens they could cover, per phase."""

    # Not graph-safe: each call rebinds Python references to new tensors, which a replayed graph would
    # never update (and padded graph rows would count). The harness measures quality, not speed.
    cuda_graph_safe = False

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget what was counted (to measure the next request alone)."""
        self.selected: dict[str, Any] = {"prefill": 0.0, "decode": 0.0}
        self.visible: dict[str, Any] = {"prefill": 0.0, "decode": 0.0}

    def on_blocks_selected(self, ctx: PolicyContext, block_indices: torch.Tensor) -> None:
        bs = ctx.block_size
        blocks = block_indices.long()
        history = ctx.history_lens.long()
        lens = history.view(-1, *([1] * (blocks.dim() - 1)))
        covered = ((lens - blocks * bs).clamp(0, bs) * (blocks >= 0)).sum(-1).float()
        if covered.dim() == 2:  # per KV head: the mean over heads
            covered = covered.mean(-1)
        phase = "prefill" if ctx.is_prefill else "decode"
        self.selected[phase] = self.selected[phase] + covered.sum()
        self.visible[phase] = self.visible[phase] + history.sum().float()

    def density(self, phase: str) -> float | None:
        """Share of the history the selections covered (``None``: no selection ran in that phase)."""
        visible = float(self.visible[phase])
        return float(self.selected[phase]) / visible if visible else None


@attrs.define
class PerplexityResult:
    policy: str
    perplexity: float
    mean_nll: float
    tail_tokens: int
    tail_step: int
    decode_density: float | None  # None: no block selection ran (dense)
    prefill_density: float | None


def tail_perplexity(
    sparse_policy: str | dict,
    token_ids: list[int],
    tail_tokens: int,
    *,
    model: str | None = None,
    device: str = "auto",
    prefill_chunk: int = 512,
    tail_step: int | None = None,
    **engine_options: Any,
) -> PerplexityResult:
    """Perplexity of the last ``tail_tokens`` of ``token_ids`` (built-in model unless ``model``).

    ``tail_step`` defaults to 1 when the decode phase runs a policy other than ``full`` (the tail goes
    through the decode path), else to ``prefill_chunk``. A progress bar counts the text's tokens.
    """
    from nanovllm import LLM

    if not 0 < tail_tokens < len(token_ids) - 1:
        raise ValueError(f"tail_tokens must be in [1, {len(token_ids) - 2}], got {tail_tokens}")
    meter = DensityMeter()
    llm = LLM(
        model, device=device, sparse_policy=sparse_policy, max_model_len=len(token_ids) + 1,
        max_num_batched_tokens=prefill_chunk, enable_prefix_caching=False, observers=[meter],
        **engine_options,
    )
    if tail_step is None:
        tail_step = 1 if llm.policy_plan.decode.selection.name != "full" else prefill_chunk
    nll = engine_tail_nll(llm, token_ids, tail_tokens, prefill_chunk, tail_step)
    return PerplexityResult(
        str(llm.policy_plan), math.exp(nll), nll, tail_tokens, tail_step,
        meter.density("decode"), meter.density("prefill"),
    )


def engine_tail_nll(llm, token_ids: list[int], tail_tokens: int, prefill_chunk: int, tail_step: int) -> float:
    """Mean negative log-likelihood (nats) of the last ``tail_tokens`` of ``token_ids`` on ``llm``, an
    engine with ``enable_prefix_caching=False`` and ``max_num_batched_tokens`` at least ``prefill_chunk``
    and ``tail_step``, running nothing else: the head in chunks of ``prefill_chunk`` tokens, the tail in
    steps of ``tail_step``. A progress bar counts the text's tokens."""
    from nanovllm import SamplingParams

    if not 0 < tail_tokens < len(token_ids) - 1:
        raise ValueError(f"tail_tokens must be in [1, {len(token_ids) - 2}], got {tail_tokens}")
    seq = llm.add_request({"prompt_token_ids": list(token_ids)},
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    head = len(token_ids) - tail_tokens
    scheduler = llm.scheduler
    budget = scheduler.max_num_batched_tokens
    try:
        with progress_bar(len(token_ids), f"perplexity {llm.policy_plan}", "tok") as bar:
            while scheduler.has_unfinished():
                done = seq.num_computed_tokens
                bar.update(done - bar.n)
                # Row p predicts token p + 1: the head in chunks up to the row that predicts the tail's
                # first token, then the tail's rows in tail_step steps.
                last_head_row = head - 1
                scheduler.max_num_batched_tokens = (
                    min(prefill_chunk, last_head_row - done) if done < last_head_row else tail_step
                )
                llm.step()
            bar.update(len(token_ids) - bar.n)
    finally:
        scheduler.max_num_batched_tokens = budget
    output = llm.output_builder.output(seq)
    if output.outputs[0].error is not None:
        raise RuntimeError(f"the perplexity request failed in the engine: {output.outputs[0].error}")
    prompt_logprobs = output.prompt_logprobs
    return -sum(prompt_logprobs[p][token_ids[p]].logprob for p in range(head, len(token_ids))) / tail_tokens
