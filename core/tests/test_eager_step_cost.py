"""An eager step's host work per attention layer stays what it was before KV cache groups (hybrid KV).

Every prefill and mixed step runs eagerly, so each Python call an attention layer makes is paid once per
layer per step. Traced with ``sys.setprofile`` over one eager decode step on the CPU: the step's view of
each KV cache group (``StepMetadata``, ``PhaseMetadata``) is made once per step before the forward pass,
never inside it; a one-group model's layers never ask for a group's view; and the calls of nanovllm code
(torch's own Python left out, so the count does not follow the torch version) per attention layer of a
one-group model stay within what they were before the groups came.
"""

from __future__ import annotations

import sys
from collections import Counter

import attrs
import pytest
from nanovllm import SamplingParams
from nanovllm.attention import metadata
from nanovllm.attention.metadata import PhaseMetadata, StepMetadata
from nanovllm.layers.attention import Attention
from nanovllm.plugins import get_plugins
from nanovllm.testing import HYBRID_BLOCK_SIZE

pytestmark = pytest.mark.usefixtures("one_thread")

# nanovllm's Python calls under one attention layer's forward in a batch-1 eager decode step, torch backend,
# full policy: 22 before KV cache groups (2d7a762) and after them; the count of the same trace at that commit
BUDGET_PER_LAYER = 22


@attrs.define
class StepTrace:
    """What one engine step did, as the profiler saw it."""

    layer_calls: list[int] = attrs.Factory(list)  # nanovllm calls under each Attention.forward, in order
    made: Counter = attrs.Factory(Counter)  # step metadata objects made, by (class, inside the forward pass)
    of_group: int = 0  # StepMetadata.of_group calls


def is_nanovllm(frame) -> bool:
    name = frame.f_globals.get("__name__") or ""
    return name.startswith("nanovllm") or frame.f_code.co_filename.startswith("<attrs generated")


def trace_steps(llm, prompt: list[int], max_tokens: int) -> list[StepTrace]:
    """Generate greedily, tracing each engine step."""
    forward = Attention.forward.__code__
    inits = {StepMetadata.__init__.__code__: "StepMetadata", PhaseMetadata.__init__.__code__: "PhaseMetadata"}
    of_group = getattr(StepMetadata, "of_group", None)
    of_group = of_group.__code__ if of_group is not None else None
    traces: list[StepTrace] = []
    depth = 0

    def profile(frame, event, _arg) -> None:
        nonlocal depth
        code = frame.f_code
        if event == "return" and code is forward:
            depth -= 1
        if event != "call":
            return
        trace = traces[-1]
        if code is forward:
            depth += 1
            trace.layer_calls.append(0)
        if depth and is_nanovllm(frame):
            trace.layer_calls[-1] += 1
        if code in inits:
            trace.made[inits[code], metadata._context is not None] += 1
        elif code is of_group:
            trace.of_group += 1

    engine = llm.llm_engine
    step = engine.step

    def traced_step():
        traces.append(StepTrace())
        sys.setprofile(profile)
        try:
            return step()
        finally:
            sys.setprofile(None)

    engine.step = traced_step
    try:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                     use_tqdm=False)
    finally:
        engine.step = step
    return traces


def make_llm(model: str, device: str = "cpu", backend: str = "torch", **options):
    from nanovllm import LLM

    return LLM(model, device=device, attention_backend=backend, kv_cache_memory=1 << 24, max_model_len=256,
               enforce_eager=True, async_scheduling=False, **options)


# (device, attention backend): the CPU's torch backend, and on a GPU the Triton backend's host path
BACKENDS = [pytest.param(("cpu", "torch"), id="cpu-torch"),
            pytest.param(("cuda", "triton"), id="gpu-triton", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", params=BACKENDS)
def qwen3(request, tiny_model):
    if "Qwen3ForCausalLM" not in get_plugins().registry.model_families:
        pytest.skip("needs the nanovllm-qwen3 plugin")
    device, backend = request.param
    # head size 32: one the Triton backend takes
    llm = make_llm(tiny_model("Qwen3ForCausalLM", num_hidden_layers=4), device, backend, block_size=16)
    trace_steps(llm, [5, 6, 7, 8, 9], 4)  # warm: kernels compiled, first-call caches filled
    return llm


def decode_steps(traces: list[StepTrace], num_layers: int) -> list[StepTrace]:
    """The steps after the prompt's, which decode one token through every layer."""
    steps = traces[1:]
    layers_seen = [len(t.layer_calls) for t in traces]
    assert steps and all(len(t.layer_calls) == num_layers for t in steps), layers_seen
    return steps


def test_one_group_layers_do_no_work_for_groups(qwen3):
    runner = qwen3.runner
    assert len(runner.kv_cache_groups) == 1
    for trace in decode_steps(trace_steps(qwen3, [5, 6, 7, 8, 9], 4), len(runner.attention_layers)):
        assert trace.of_group == 0, "a one-group model's layers asked for a group's view of the step"
        assert trace.made == {("StepMetadata", False): 1, ("PhaseMetadata", False): 1}, (
            f"step metadata made in a one-group decode step (class, inside the forward pass): {trace.made}")
        assert len(set(trace.layer_calls)) == 1, f"the layers made different calls: {trace.layer_calls}"
        assert runner.backend.name != "torch" or trace.layer_calls[0] <= BUDGET_PER_LAYER, (
            f"{trace.layer_calls[0]} nanovllm calls under each attention layer in an eager decode step, "
            f"{BUDGET_PER_LAYER} before KV cache groups: every eager step pays them once per layer")


def test_hybrid_groups_views_are_made_once_per_step(tiny_model):
    if "Gemma3ForCausalLM" not in get_plugins().registry.model_families:
        pytest.skip("needs the nanovllm-gemma3 plugin")
    llm = make_llm(tiny_model("Gemma3ForCausalLM"), block_size=HYBRID_BLOCK_SIZE)
    runner = llm.runner
    groups = runner.kv_cache_groups
    assert len(groups) > 1, "the tiny Gemma 3 should have several KV cache groups"
    later_layers = sum(len(g.layer_ids) for g in groups[1:])
    for trace in decode_steps(trace_steps(llm, list(range(5, 25)), 3), len(runner.attention_layers)):
        # one view of the step per group, each made before the forward pass; a layer only looks its own up
        assert trace.made == {("StepMetadata", False): len(groups), ("PhaseMetadata", False): len(groups)}, (
            f"step metadata made in a hybrid decode step (class, inside the forward pass): {trace.made}")
        assert trace.of_group == later_layers
