"""The step uploads' pinned buffers: what arrives is what was sent, a buffer is not written while the GPU may
still copy out of it, and an engine's steps pin no new memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm.engine.pinned_staging import PinnedStaging

pytestmark = pytest.mark.gpu


def test_uploads_arrive_whole_across_growth_and_dtypes():
    staging = PinnedStaging(torch.device("cuda"), depth=2, initial_bytes=256)
    rng = np.random.default_rng(0)
    sent, got = [], []
    for step in range(5):
        with staging.step():
            for shape, dtype in [((3, 7), np.int64), ((0,), np.int32), ((2, 50, 3), np.int32), ((5,), np.bool_),
                                 ((40 * (step + 1),), np.float32)]:
                array = (rng.random(shape) * 1000).astype(dtype)
                sent.append(array)
                got.append(staging.upload(array))
    torch.cuda.synchronize()
    assert max(b.numel() for b in staging.buffers) > 256  # it grew
    for array, tensor in zip(sent, got, strict=True):
        assert tensor.device.type == "cuda" and tuple(tensor.shape) == array.shape
        assert np.array_equal(tensor.cpu().numpy(), array)


def test_arrays_uploaded_together_arrive_whole_from_one_transfer():
    staging = PinnedStaging(torch.device("cuda"), depth=2, initial_bytes=256)
    rng = np.random.default_rng(1)
    for step in range(4):
        with staging.step():
            first = staging.upload(np.arange(5, dtype=np.int32))
            sent = [(rng.random(shape) * 1000).astype(dtype) for shape, dtype in
                    [((3, 7), np.int64), ((0,), np.int32), ((2, 9, 3), np.int32), ((5,), np.bool_),
                     ((30 * (step + 1),), np.float32)]]
            sent.append(np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2])  # not contiguous
            got = staging.upload_many(sent)
        torch.cuda.synchronize()
        assert np.array_equal(first.cpu().numpy(), np.arange(5))
        assert len({t.untyped_storage().data_ptr() for t in got}) == 1  # views of one copy
        for array, tensor in zip(sent, got, strict=True):
            assert tensor.dtype == torch.from_numpy(np.ascontiguousarray(array)).dtype
            assert tensor.data_ptr() % 16 == 0 and tensor.is_contiguous()
            assert np.array_equal(tensor.cpu().numpy(), array)


def test_a_buffer_is_not_rewritten_before_its_copies_ran():
    staging = PinnedStaging(torch.device("cuda"), depth=2)
    with staging.step():
        torch.cuda._sleep(200_000_000)  # the copy below waits behind this on the stream
        first = staging.upload(np.full(1000, 1, dtype=np.int64))
    with staging.step():
        staging.upload(np.full(1000, 2, dtype=np.int64))
    with staging.step():  # the first step's buffer again: its copy must have run before it is written
        staging.upload(np.full(1000, 3, dtype=np.int64))
    torch.cuda.synchronize()
    assert torch.all(first == 1)


def test_engine_steps_pin_no_new_memory(tiny_model, monkeypatch):
    from nanovllm import LLM, SamplingParams

    llm = LLM(tiny_model("LlamaForCausalLM"), max_num_batched_tokens=64, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate([[5] * 150, [7] * 20], params, use_tqdm=False)
    pinned = []
    pin = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: pinned.append(t.shape) or pin(t, *a, **k))
    got = llm.generate([[5] * 150, [7] * 20], params, use_tqdm=False)
    assert not pinned
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
