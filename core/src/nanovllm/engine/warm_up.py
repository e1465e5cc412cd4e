"""The start-up warm-up of a model runner: eager steps that write nothing, so that the kernels a later step
would compile (prefill chunks long and short, steps of few rows, sampling) compile before the first request."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from nanovllm.attention.metadata import PhaseMetadata, StepMetadata, forward_context
from nanovllm.kernel_sizes import CHAINED_LAUNCH_MAX_ROWS
from nanovllm.kv.offload import HostPhase

if TYPE_CHECKING:
    from nanovllm.engine.model_runner import ModelRunner


@attrs.frozen
class WarmUpStep:
    """A step of the start-up warm-up: ``decodes`` decode rows (a context of 1 each), then one prefill chunk
    of each of ``chunks`` tokens, each after ``history`` tokens of cached context."""

    decodes: int
    chunks: tuple[int, ...] = ()
    history: int = 0

    @property
    def rows(self) -> int:
        return self.decodes + sum(self.chunks)

    @property
    def sample_rows(self) -> list[int]:
        """The last row of each sequence: the rows the engine samples."""
        return [*range(self.decodes), *(self.decodes + np.cumsum(self.chunks) - 1).tolist()]


def warm_up_steps(max_model_len: int, block_size: int, max_num_seqs: int) -> list[WarmUpStep]:
    """The steps the runner warms up with, each with kernel variants that a later eager step would
    otherwise compile:

    - a long and a short chunk after a history that reaches ``max_model_len``: the paged kernels and the
      policies' long-context paths (e.g. past a ``dense_below``);
    - two short fresh chunks;
    - one fresh chunk of up to 96 tokens alone (torch SDPA's path on CUDA), and two together: attention
      over their own new keys, past 64 tokens with the long-chunk kernel configuration;
    - steps of 1 (a prompt cached but for its last token), 2, 4, 8, 12 and 16 rows, of 1, 2, 3, 8, 10 and
      16 sequences (at most ``max_num_seqs``; the last row of each is sampled): the small-batch matmul's
      variants (per power of two of rows up to 16, and 16 itself) in the layers and in the LM head;
    - where ``max_num_seqs`` allows, one more decode row than launch chained
      (:data:`~nanovllm.kernel_sizes.CHAINED_LAUNCH_MAX_ROWS`): the decode kernels' unchained variant.
    """
    long = min(max_model_len, 96)
    steps = [
        WarmUpStep(1, (long, 8), max_model_len - long),
        WarmUpStep(1, (8, 8)),
        WarmUpStep(1, (long,)),
        WarmUpStep(1, (long, long)),
    ]
    for rows, seqs in ((1, 1), (2, 2), (4, 3), (8, 8), (12, 10), (16, 16)):
        decodes = min(seqs, max_num_seqs) - 1
        history = min(block_size, max_model_len - 1) if rows == 1 else 0
        steps.append(WarmUpStep(decodes, (rows - decodes,), history))
    if max_num_seqs > CHAINED_LAUNCH_MAX_ROWS + 1:
        steps.append(WarmUpStep(CHAINED_LAUNCH_MAX_ROWS + 1, (1,)))
    return steps


@torch.inference_mode()
def warm_up(runner: ModelRunner) -> None:
    """Run the steps of :func:`warm_up_steps` on ``runner``'s model, eagerly; each computes the logits of its
    sequences' last rows and samples them through the runner's sampler (greedy and temperature rows
    alternately), as the engine does. Then the logits of 1 to ``max_num_seqs`` rows, once each. So the
    kernels of prefill steps, of steps of few rows, of the LM head and of sampling compile or load now and
    not inside the first requests. They write nothing: every new token's slot is -1 and
    every block table reads block 0, zeroed first; the draws come from a fork of torch's generators, so the
    run's random streams are as if no warm-up had run. With offload the history is read from the pool, as a
    long prompt's would be."""
    dev = runner.device

    def phase(lens: list[int], history: int = 0, prefill: bool = False) -> PhaseMetadata | None:
        if not lens:
            return None
        width = -(-(max(lens) + history) // runner.block_size)
        tables = torch.zeros(len(lens), width, dtype=torch.int32, device=dev)
        cu = torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32, device=dev)
        host = (tuple(lens), tuple(n + history for n in lens)) if prefill else (None, None)  # as the runner's
        return PhaseMetadata(cu, cu[1:] - cu[:-1] + history, tables, max(lens), max(lens) + history, *host)

    def host(lens: list[int], history: int = 0) -> HostPhase | None:
        if not lens:
            return None
        width = -(-(max(lens) + history) // runner.block_size)
        return HostPhase([[0] * width] * len(lens), lens, [n + history for n in lens])

    # block 0 (of the pool, with offload) is no one's yet: zeros, not what the memory held, so no NaN
    # reaches a policy
    for layer in runner.attention_layers:
        layer.k_cache[0].zero_()
        layer.v_cache[0].zero_()
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        for step in warm_up_steps(runner.max_model_len, runner.block_size, runner.config.max_num_seqs):
            decodes, chunks = [1] * step.decodes, list(step.chunks)
            ids = torch.zeros(step.rows, dtype=torch.long, device=dev)
            slots = torch.full((step.rows,), -1, dtype=torch.long, device=dev)
            meta = StepMetadata(slots, ids, step.decodes, phase(decodes),
                                phase(chunks, step.history, prefill=True))
            meta = attrs.evolve(meta, other_groups=(meta,) * (len(runner.kv_cache_groups) - 1))  # no writes
            runner.kv.begin_step(host(decodes), host(chunks, step.history))
            with forward_context(meta):
                hidden = runner.model(ids, ids.clone())
            rows = step.sample_rows
            if len(rows) < step.rows:
                hidden = hidden[torch.tensor(rows, device=dev)]
            logits = runner.model.compute_logits(hidden)
            if logits is not None:  # rank 0 samples
                temperatures = (torch.arange(len(rows), device=dev) % 2).float()  # greedy, drawn, ...
                runner.sampler(logits, temperatures)
        # the LM head at every number of sampled rows a step can have: a cuBLAS matmul's first call at a row
        # count it has not run can wait for the GPU, which would stall the host in the step that first
        # samples that many rows, and the host would no longer run ahead of the GPU
        zeros = hidden.new_zeros(runner.config.max_num_seqs, hidden.shape[-1])
        for n in range(1, zeros.shape[0] + 1):
            runner.model.compute_logits(zeros[:n])
    if dev.type == "cuda":
        torch.cuda.synchronize()
