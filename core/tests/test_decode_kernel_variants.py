"""How many compiled variants the split-KV decode kernels need. An eager decode (the decode rows of a step
that also prefills) launches them for whatever batch and context length the step has; a launch whose
compile key (constexprs, and the specialisation of the integer arguments) is new makes Triton compile,
which takes a fraction of a second inside that step. So the keys must not follow the number of splits,
which changes with the batch and the context length. Checked on the CPU: the kernels are stood in for by
a recorder of compile keys, nothing runs."""

from __future__ import annotations

import pytest
import torch

from nanovllm.attention import triton_kernels as tk

H200_SMS = 132


class CompileKeys:
    """Stands in for a Triton kernel: records each launch's compile key as Triton makes it from the
    arguments: the constexprs and launch options, and per integer argument that Triton specialises,
    whether it is 1 or a multiple of 16."""

    def __init__(self, kernel) -> None:
        self.params = kernel.params
        self.keys: set[tuple] = set()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            values = dict(zip([p.name for p in self.params], args)) | kwargs
            key = []
            for p in self.params:
                value = values[p.name] if p.name in values else p.default
                if p.is_constexpr:
                    key.append((p.name, value))
                elif isinstance(value, int) and not isinstance(value, bool) and not p.do_not_specialize:
                    key.append((p.name, value == 1, value % 16 == 0))
            self.keys.add((*key, kwargs.get("num_warps"), kwargs.get("num_stages")))

        return launch


@pytest.fixture
def kernels(monkeypatch):
    decode, reduce = CompileKeys(tk._decode_kernel), CompileKeys(tk._reduce_kernel)
    monkeypatch.setattr(tk, "_decode_kernel", decode)
    monkeypatch.setattr(tk, "_reduce_kernel", reduce)
    monkeypatch.setattr(tk, "num_sms", lambda device: H200_SMS)  # the split counts of a large GPU
    return decode, reduce


def decode(num_seqs: int, context: int, max_keys: int, heads: int = 4, kv_heads: int = 1, head_dim: int = 256,
           block_size: int = 16, window: int | None = None, config: tk.DecodeConfig | None = None) -> int:
    """One launch of ``attention_decode`` as a Gemma 3 270M layer makes it (4 query heads, 1 KV head of
    256), with the CPU's knobs unless ``config`` is given; its number of splits."""
    k = torch.empty(1, block_size, kv_heads, head_dim)  # nothing reads the tensors: their shapes count
    q = torch.empty(num_seqs, heads, head_dim)
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    tables = torch.empty(num_seqs, -(-max_keys // block_size), dtype=torch.int32)
    cfg = config or tk._decode_config(head_dim, q.dtype, q.device, block_size)
    tk.attention_decode(q, k, k, torch.empty_like(q), None, lens, tables, None, max_keys, 1.0, window=window,
                        config=cfg)
    keys = min(max_keys, window + cfg.block_n) if window else max_keys
    return tk.num_decode_splits(num_seqs, kv_heads, keys, cfg.block_n, q.device, cfg.programs_per_sm,
                                cfg.max_splits, cfg.wave_fit, cfg.one_split_waves, cfg.full_wave_programs)


def test_eager_decode_rows_of_mixed_steps_need_no_kernel_the_graph_capture_did_not_compile(kernels):
    # the long-context benchmark: max_model_len 32833, decode graphs of 1, 2, 4 and 8 sequences; then
    # steps that prefill the 8th prompt while the first 7 decode, with 1 to 7 decode rows at ~32K keys
    max_model_len = 32833
    for bs in (1, 2, 4, 8):
        for window in (None, 512):
            decode(bs, 1, max_model_len, window=window)
    captured = [set(k.keys) for k in kernels]
    splits = {decode(rows, 32768 + rows, 32768 + rows) for rows in range(1, 8)}
    assert len(splits) > 2  # the steps do need other split counts than the graphs
    for kernel, before in zip(kernels, captured, strict=True):
        assert kernel.keys == before, "an eager decode step compiles a kernel variant of its own"


def test_decode_kernels_compile_a_few_variants_whatever_the_batch_and_context(kernels):
    splits = {decode(num_seqs, context, context)
              for num_seqs in range(1, 65) for context in range(16, 70000, 997)}
    assert len(splits) > 20
    decode_kernel, reduce_kernel = kernels
    assert len(decode_kernel.keys) <= 2  # with splits and without
    assert len(reduce_kernel.keys) <= 2  # few splits merged in small chunks, many in large ones


def test_one_split_from_a_batch_on_is_compiled_by_the_largest_decode_graph(kernels):
    """With ``one_split_waves`` the rule picks one split (a kernel variant of its own) from some batch on.
    B1's engine (qwen3-0.6b: 16 query heads, 8 KV heads of 128; max_model_len 4096, graphs of up to 256
    sequences) compiles it and the split one while it warms its graphs up; eager decode rows of any count
    up to the largest graph, at any context, then compile nothing."""
    cfg = tk.DECODE._replace(one_split_waves=4)
    b1 = dict(heads=16, kv_heads=8, head_dim=128, config=cfg)
    sizes = (1, 2, 4, 8, *range(16, 257, 16))  # CudaGraphRunner's batch buckets for max_num_seqs 256
    graphs = {decode(bs, 1, 4096, **b1) for bs in sizes}
    captured = [set(k.keys) for k in kernels]
    eager = {decode(rows, context, context, **b1) for rows in range(1, 257, 3)
             for context in (150, 600, 4096)}
    assert 1 in graphs and len(graphs) > 2 and 1 in eager and len(eager) > 2
    for kernel, before in zip(kernels, captured, strict=True):
        assert kernel.keys == before, "an eager decode step compiles a kernel variant of its own"
