"""How many compiled variants the one-pass sampler needs. The engine samples batches of every size, and a
launch whose compile key (constexprs, launch options, and the specialisation of the integer arguments) is
new makes Triton compile inside that step. So a model's keys must not follow the rows. Checked on the CPU:
the kernels are stood in for by the decode test's recorder of compile keys, nothing runs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_decode_kernel_variants import H200_SMS, CompileKeys  # noqa: E402

from nanovllm.layers import sampler_kernels as sk  # noqa: E402


class Launches(CompileKeys):
    """The recorder of compile keys, keeping each launch's grid too."""

    def __init__(self, kernel) -> None:
        super().__init__(kernel)
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return super().__getitem__(grid)


def constexpr(key: tuple, name: str):
    return next(item[1] for item in key if isinstance(item, tuple) and item[0] == name)


@pytest.fixture
def kernels(monkeypatch):
    sample, merge = Launches(sk._sample_kernel), Launches(sk._merge_kernel)
    monkeypatch.setattr(sk, "_sample_kernel", sample)
    monkeypatch.setattr(sk, "_merge_kernel", merge)
    monkeypatch.setattr(sk, "num_sms", lambda device: H200_SMS)  # the split counts of a large GPU
    return sample, merge


# Qwen3 and Qwen2.5 (151,936), Gemma 3 (262,208), SmolLM2 (49,152), Llama 2 (32,000), a small one
@pytest.mark.parametrize("vocab", [151_936, 262_208, 49_152, 32_000, 5_000])
def test_every_batch_size_runs_the_variants_of_the_first(kernels, vocab):
    logits = torch.empty(512, vocab, dtype=torch.bfloat16)  # nothing reads it: its shape and strides count
    temperatures = torch.empty(512)
    for rows in range(1, 513):
        sk.sample(logits[:rows], temperatures[:rows])
    sample, merge = kernels
    splits = {grid[1] for grid in sample.grids}
    assert len(sample.keys) == 1, sorted(sample.keys)
    if vocab >= 2 * sk.MIN_TILES_PER_SPLIT * 4 * sk.MAX_LANES:  # long enough to split: always split
        assert len(splits) > 2 and min(splits) >= 2  # the split count does follow the rows
        assert len(merge.keys) == 1, sorted(merge.keys)
        assert max(splits) <= constexpr(next(iter(merge.keys)), "SPLITS_PAD")  # every split is merged
    else:
        assert splits == {1} and not merge.keys


def test_explicit_splits_merge_with_the_vocabularys_variant(kernels):
    """Benchmarks and tests choose the split: one split runs the kernel unsplit (a variant of its own),
    any other count the variants the engine's batches compile, the merge padded to all of them."""
    logits, temperatures = torch.empty(4, 151_936), torch.empty(4)
    sk.sample(logits, temperatures)
    sample, merge = kernels
    engine = set(sample.keys), set(merge.keys)
    for splits in (2, 3, 7, 38, 100):
        sk.sample(logits, temperatures, splits)
    assert (sample.keys, merge.keys) == engine
    assert max(grid[1] for grid in sample.grids) <= constexpr(next(iter(merge.keys)), "SPLITS_PAD")
    sk.sample(logits, temperatures, 1)
    assert len(sample.keys) == 2 and merge.keys == engine[1]
