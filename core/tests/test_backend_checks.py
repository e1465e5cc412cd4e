"""The boundary helpers of :mod:`nanovllm.attention.backend` that kernels over a prefill phase share (plugins'
kernels too): the outputs they fill, and the refusals that name the fix."""

from __future__ import annotations

import pytest
import torch
from nanovllm.attention.backend import prefill_kernel_outputs


class InterpretedFunction:
    """Stands for a kernel that Triton built for its interpreter (the helper reads only the type's name)."""


def compiled_kernel():
    """Stands for a kernel built for the GPU."""


def _inputs(num_tokens: int, num_seqs: int):
    q = torch.zeros(num_tokens, 4, 8, dtype=torch.bfloat16)
    cu = torch.linspace(0, num_tokens, num_seqs + 1).int()
    return q, cu


def test_outputs_have_the_kernels_shapes_and_dtypes():
    q, cu = _inputs(10, 2)
    out, lse, launch = prefill_kernel_outputs(InterpretedFunction(), "kernel", q, cu, [cu], "the lengths")
    assert launch
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (10, 4) and lse.dtype == torch.float32


@pytest.mark.parametrize("num_tokens,num_seqs", [(0, 2), (0, 0)])
def test_nothing_to_compute_launches_nothing_even_without_the_interpreter(num_tokens, num_seqs):
    q, cu = _inputs(num_tokens, num_seqs)
    out, lse, launch = prefill_kernel_outputs(compiled_kernel, "kernel", q, cu, [cu], "the lengths")
    assert not launch and out.shape == (0, 4, 8) and lse.shape == (0, 4)


def test_cpu_tensors_need_the_interpreter():
    q, cu = _inputs(10, 2)
    with pytest.raises(ValueError, match="use my_attention_reference on the CPU, or set TRITON_INTERPRET=1"):
        prefill_kernel_outputs(compiled_kernel, "my_attention", q, cu, [cu], "the lengths")


def test_inputs_off_qs_device_are_refused():
    q, cu = _inputs(10, 2)
    with pytest.raises(ValueError, match=r"the block lists must be on q's device \(cpu\)"):
        prefill_kernel_outputs(InterpretedFunction(), "kernel", q, cu, [cu, cu.to("meta")], "the block lists")
