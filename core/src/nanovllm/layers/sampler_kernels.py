"""One-pass sampling in Triton for the common case: temperatures only (0: greedy), no logits processing, no
min-p, top-k or top-p, no per-request seeds.

The sampler's exponential race, ``argmax(p / E)`` with ``p = softmax(logits / T)`` and ``E ~ Exp(1)``, picks
the token of ``argmax(logits / T - log E)``: the softmax's normaliser is the same for every token of a row,
so no softmax is needed. Each program reads its part of a row once, in tiles, drawing ``E`` from Triton's
Philox generator (one call gives four sub-tiles' numbers), and keeps the best score and its first column; a
greedy row (``T == 0``) keeps the plain argmax and draws nothing. Ties and masked tokens behave as in the
torch path: the first of equal maxima wins, a ``-inf`` logit is never drawn, and a row that is all ``-inf``
gives token 0.

Long rows are split over several programs (at least two, more at small batches), whose bests a second,
tiny kernel merges. The draws depend on the step's seed, the row and the column only, not on the split.
The kernels' compile keys depend on the vocabulary only, never on the batch, so every row count a model
samples runs the variants its first call compiled (Triton compiles anew for each new set of constexprs,
and for an integer argument that becomes 1 or a multiple of 16 unless it is left unspecialised). The seed
is drawn on the device from torch's generator each call (so ``torch.manual_seed`` reproduces a run, and
CUDA graphs can capture the call): nothing is read back to the host. On CPU tensors the kernels run under
Triton's interpreter (tests only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanovllm.attention.triton_kernels import num_sms
from nanovllm.kernel_sizes import cdiv, next_power_of_2

MAX_LANES = 1024  # a tile is four sub-tiles of this many columns, one per Philox output
MIN_TILES_PER_SPLIT = 2  # a split shorter than this costs more in its merge than it gains
# rows are split until about this many programs share each multiprocessor: four of eight warps fit one
# (64 registers a thread on sm_90)
PROGRAMS_PER_SM = 4
_NO_INDEX = tl.constexpr(2**31 - 1)  # above any column: loses every tie


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:  # the GPU's approximate lg2: one instruction, absolute error about 2**-22 (no interpreter)
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _exponential_log2e(bits, FAST_LOG: tl.constexpr):
    """``E * log2(e)`` with ``E ~ Exp(1)``, from 32 random bits. ``E = -ln(1 - w)``, ``w`` uniform in (0, 1),
    is taken from its series where ``w`` is small: there ``E`` is small, the noise favours the token most,
    and an approximate log of ``1 - w`` would be off by more than ``E`` itself. ``w`` never 0: ``E = 0``
    would make its token win whatever its logit."""
    w = ((bits >> 1).to(tl.float32) + 0.5) * 4.656612873077393e-10  # 31 bits over 2**31
    series = w * (1.0 + w * (0.5 + w * 0.3333333333333333)) * 1.4426950408889634
    return tl.where(w < 0.015625, series, -_log2(1.0 - w, FAST_LOG))


@triton.jit
def _keep_better(X, cols, n_cols, best, best_idx, scale, bits, NOISE: tl.constexpr, FAST_LOG: tl.constexpr):
    """The running best per lane after the sub-tile ``cols``: strictly better only, so each lane keeps the
    first column of its maximum. With ``NOISE`` the score is ``(logit / T - ln E) * log2(e)`` (``scale`` is
    ``log2(e) / T``), up to a constant: the race's order in base 2."""
    score = tl.load(X + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    if NOISE:
        score = score * scale - _log2(_exponential_log2e(bits, FAST_LOG), FAST_LOG)
    better = score > best
    return tl.where(better, score, best), tl.where(better, cols, best_idx)


@triton.jit
def _best_in_tiles(X, row, first, last, n_cols, scale, seed, LANES: tl.constexpr, NOISE: tl.constexpr,
                   FAST_LOG: tl.constexpr):
    """(best score, its first column) over tiles ``first`` to ``last`` of one row."""
    lanes = tl.arange(0, LANES)
    best = tl.full([LANES], float("-inf"), tl.float32)
    best_idx = first * 4 * LANES + lanes  # a row of -inf keeps its first column
    for tile in range(first, last):
        start = tile * 4 * LANES
        if NOISE:  # one Philox call gives the four sub-tiles' numbers: counter (row, tile lane)
            r0, r1, r2, r3 = tl.randint4x(seed, (row.to(tl.int64) << 32) | (tile * LANES + lanes))
        else:  # unread
            r0, r1, r2, r3 = lanes, lanes, lanes, lanes
        cols = start + lanes
        best, best_idx = _keep_better(X, cols, n_cols, best, best_idx, scale, r0, NOISE, FAST_LOG)
        best, best_idx = _keep_better(X, cols + LANES, n_cols, best, best_idx, scale, r1, NOISE, FAST_LOG)
        best, best_idx = _keep_better(X, cols + 2 * LANES, n_cols, best, best_idx, scale, r2, NOISE, FAST_LOG)
        best, best_idx = _keep_better(X, cols + 3 * LANES, n_cols, best, best_idx, scale, r3, NOISE, FAST_LOG)
    top = tl.max(best, 0)
    return top, tl.min(tl.where(best == top, best_idx, _NO_INDEX), 0)


@triton.jit(do_not_specialize=["tiles_per_split"])  # it follows the rows
def _sample_kernel(
    Logits, Temperatures, Seed, Out, PartBest, PartIdx, n_cols, stride_row, tiles_per_split, n_tiles,
    LANES: tl.constexpr, SPLIT: tl.constexpr, FAST_LOG: tl.constexpr,
):
    """Program (row, split): the row's sampled token (or, with ``SPLIT``, this split's best and column)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    X = Logits + row.to(tl.int64) * stride_row
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, n_tiles)
    t = tl.load(Temperatures + row).to(tl.float32)
    if t > 0:
        scale = 1.4426950408889634 / t
        top, idx = _best_in_tiles(X, row, first, last, n_cols, scale, tl.load(Seed), LANES, True, FAST_LOG)
    else:
        top, idx = _best_in_tiles(X, row, first, last, n_cols, 1.0, 0, LANES, False, FAST_LOG)
    if SPLIT:
        part = row * tl.num_programs(1) + split
        tl.store(PartBest + part, top)
        tl.store(PartIdx + part, idx)
    else:
        tl.store(Out + row, idx.to(tl.int64))


@triton.jit(do_not_specialize=["splits"])  # it follows the rows
def _merge_kernel(PartBest, PartIdx, Out, splits, SPLITS_PAD: tl.constexpr):
    """Row ``program_id(0)``: the first column of the best of its splits' bests."""
    row = tl.program_id(0)
    s = tl.arange(0, SPLITS_PAD)
    ok = s < splits
    best = tl.load(PartBest + row * splits + s, mask=ok, other=float("-inf"))
    idx = tl.load(PartIdx + row * splits + s, mask=ok, other=_NO_INDEX)
    top = tl.max(best, 0)
    tl.store(Out + row, tl.min(tl.where(best == top, idx, _NO_INDEX), 0).to(tl.int64))


def default_splits(rows: int, n_tiles: int, device: torch.device) -> int:
    """Programs per row for ``rows`` rows of ``n_tiles`` tiles: enough to fill the device, at least two
    (so the kernels run split whatever the batch: one compiled variant), one where the vocabulary is too
    short for two splits of ``MIN_TILES_PER_SPLIT`` tiles."""
    if n_tiles < 2 * MIN_TILES_PER_SPLIT:
        return 1
    return max(2, min(n_tiles // MIN_TILES_PER_SPLIT, PROGRAMS_PER_SM * num_sms(device) // rows))


def sample(logits: torch.Tensor, temperatures: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """Token ids ``[rows]`` (int64) drawn from ``logits [rows, vocab]`` (float32, bfloat16 or float16; math in
    float32) at ``temperatures [rows]`` (0: the argmax), as :class:`~nanovllm.layers.sampler.Sampler` draws
    them without its options. ``splits``: programs per row (default: :func:`default_splits`; at most one per
    tile); it never changes the result."""
    rows, n_cols = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    seed = torch.randint(2**62, (1,), device=logits.device)  # a fresh stream each call
    lanes = min(MAX_LANES, max(16, next_power_of_2(cdiv(n_cols, 4))))
    n_tiles = cdiv(n_cols, 4 * lanes)
    if splits is None:
        splits = default_splits(rows, n_tiles, logits.device)
    tiles_per_split = cdiv(n_tiles, max(1, min(splits, n_tiles)))
    splits = cdiv(n_tiles, tiles_per_split)
    part_best = torch.empty(rows, splits, dtype=torch.float32, device=logits.device) if splits > 1 else out
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=logits.device) if splits > 1 else out
    _sample_kernel[(rows, splits)](
        logits, temperatures, seed, out, part_best, part_idx, n_cols, logits.stride(0), tiles_per_split,
        n_tiles,
        LANES=lanes, SPLIT=splits > 1, FAST_LOG=logits.is_cuda, num_warps=max(1, min(8, lanes // 128)),
    )
    if splits > 1:  # padded to the most splits of this vocabulary (a tile each): one variant per vocabulary
        _merge_kernel[(rows,)](part_best, part_idx, out, splits, SPLITS_PAD=next_power_of_2(n_tiles),
                               num_warps=1)
    return out
