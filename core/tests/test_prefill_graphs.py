"""Piecewise prefill graphs: when a runner captures them, and that steps of ``max_num_batched_tokens`` tokens
replayed from them give the eager engine's tokens and log-probabilities (chunked prompts crossing sliding
windows, batches of prompts, decodes in the same step, prefix-cache hits, sparse policies): on a GPU from real
graphs, on the CPU from emulated stretches around the runner's own replay."""

from __future__ import annotations

import threading

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.attention.metadata import forward_context
from nanovllm.conformance import Case, _engine, _generate, _prompts, compare_outputs, hybrid_model, tiny_model
from nanovllm.engine.prefill_graphs import PrefillGraphs, Stretch
from nanovllm.plugins import get_plugins


def test_the_cpu_prefills_eagerly():
    llm = _engine(Case("prefill_graphs", "cpu", "torch"), tiny_model(), "full", enforce_eager=False)
    graphs = llm.runner.prefill_graphs
    assert not graphs.usable() and graphs.stretches == [] and not graphs.fits(512)


class ThreadedForward:
    """Emulated stretches on the CPU. The model's forward over the runner's static buffers runs in a thread
    that stops at each attention call, after copying q, k and v where they lie outside the QKV projection's
    static buffer (the torch RoPE's rotated q and k) into buffers of their own, as a captured stretch ends;
    replaying stretch ``i`` runs it on to its next stop (the first replay starts it). Between the stretches
    the runner's own ``replay`` runs: the step's inputs copied in, each attention call eager with the step's
    metadata, its output copied into the buffer the next stretch reads. (The torch backend writes K/V in the
    attention call, so the slots' buffer is read only on a GPU.)"""

    def __init__(self, graphs: PrefillGraphs) -> None:
        self.graphs = graphs
        self.resume, self.stopped = threading.Semaphore(0), threading.Semaphore(0)
        self.error: BaseException | None = None

    def replay(self, index: int) -> None:
        if index == 0:
            threading.Thread(target=self._forward, daemon=True).start()
        else:
            self.resume.release()
        self.stopped.acquire()
        if self.error is not None:
            raise self.error

    def _cuts(self, cut) -> None:
        for layer in self.graphs.attention_layers:
            layer.graph_cut = cut

    def _forward(self) -> None:
        g = self.graphs

        def cut(attention, q, k, v, kv_written):
            g.attention_inputs(q, k, v)
            self._cuts(None)  # the replay's own attention call runs meanwhile, uncut
            self.stopped.release()
            self.resume.acquire()
            self._cuts(cut)
            return g.attention_out

        try:
            with torch.inference_mode():
                self._cuts(cut)
                for layer in g.attention_layers:
                    layer.qkv_out = g.qkv
                g.output = g.model(g.input_ids, g.positions)
        except BaseException as exc:  # handed to the replay that waits
            self.error = exc
        finally:
            self._cuts(None)
            for layer in g.attention_layers:
                layer.qkv_out = None
            self.stopped.release()


class EmulatedGraph:
    def __init__(self, forward: ThreadedForward, index: int) -> None:
        self.forward, self.index = forward, index

    def replay(self) -> None:
        self.forward.replay(self.index)


@pytest.fixture
def emulated_stretches(monkeypatch):
    """Engines made after it capture emulated stretches on the CPU: one per attention call of a dry forward,
    in its order, and one after the last."""

    def capture(graphs: PrefillGraphs) -> None:
        calls = []

        def record(attention, q, k, v, kv_written):
            calls.append((attention, kv_written, graphs.attention_inputs(q, k, v)))
            return graphs.attention_out

        for layer in graphs.attention_layers:
            layer.graph_cut, layer.qkv_out = record, graphs.qkv
        try:
            with forward_context(graphs._metadata()):
                graphs.model(graphs.input_ids, graphs.positions)
        finally:
            for layer in graphs.attention_layers:
                layer.graph_cut = layer.qkv_out = None
        forward = ThreadedForward(graphs)
        graphs.stretches = [Stretch(EmulatedGraph(forward, i), *call) for i, call in enumerate(calls)]
        graphs.stretches.append(Stretch(EmulatedGraph(forward, len(calls))))

    monkeypatch.setattr(PrefillGraphs, "usable",
                        lambda g: g.config.piecewise_cuda_graphs and not g.config.enforce_eager)
    monkeypatch.setattr(PrefillGraphs, "_capture", capture)


def graphed_and_eager(model_dir: str, policy: str, monkeypatch, device: str = "cuda"
                      ) -> tuple[list, list, list[int], list[int]]:
    """The same requests on an engine with piecewise prefill graphs (steps of 64 tokens) and on one without;
    returns both outputs, the token count of each step the first replayed, and which attention inputs (0-2:
    q, k, v) its cuts copied (the others were read in place)."""
    case = Case("prefill_graphs", device, "triton" if device == "cuda" else "torch")
    options = dict(enforce_eager=False, max_num_batched_tokens=64, max_num_seqs=4)
    replayed: list[int] = []
    replay = PrefillGraphs.replay

    def counted(self, input_ids, meta):
        replayed.append(input_ids.shape[0])
        return replay(self, input_ids, meta)

    monkeypatch.setattr(PrefillGraphs, "replay", counted)
    graphed = _engine(case, model_dir, policy, **options)
    graphs = graphed.runner.prefill_graphs
    layers = len(graphed.runner.attention_layers)
    assert len(graphs.stretches) == layers + 1
    assert sum(s.attention is not None for s in graphs.stretches) == layers
    # a 300-token prompt in chunks of 64 crossing the windows; three prompts whose chunks share steps with
    # decodes; the first prompt again (its cached blocks hit, so its chunks start mid-prompt); then alone, a
    # prompt whose last chunk (60 tokens) replays padded
    prompts = _prompts([300, 90, 41, 130], 5)
    prompts.append(prompts[0][:200] + prompts[1][:50])
    alone = _prompts([188], 6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    got = _generate(graphed, prompts, params) + _generate(graphed, alone, params)
    eager = _engine(case, model_dir, policy, **options, piecewise_cuda_graphs=False)
    assert eager.runner.prefill_graphs.stretches == []
    want = _generate(eager, prompts, params) + _generate(eager, alone, params)
    return got, want, replayed, sorted(graphs.copies)


def replayed_sizes_are_right(replayed: list[int]) -> bool:
    """Steps of 64 tokens replayed, and steps of 56 to 63 (padded), at least one of each."""
    return set(replayed) <= set(range(56, 65)) and 64 in replayed and min(replayed) < 64


@pytest.mark.parametrize("hybrid", [True, False], ids=["gemma3-sliding", "llama"])
@pytest.mark.parametrize("policy", ["full", "quest:token_budget=64,skip_layers=0,page_size=16"],
                         ids=["full", "quest"])
def test_emulated_replays_give_the_eager_outputs(hybrid, policy, emulated_stretches, monkeypatch):
    """The runner's replay between emulated stretches, on the CPU: the inputs a step copies in, the attention
    calls between the stretches (Quest's KV-write hook among them) and the buffers across the cuts."""
    if policy != "full" and "quest" not in get_plugins().registry.sparse_policies:
        pytest.skip("needs the nanovllm-quest plugin")
    model_dir = hybrid_model() if hybrid else tiny_model()
    got, want, replayed, copied = graphed_and_eager(model_dir, policy, monkeypatch, device="cpu")
    assert replayed_sizes_are_right(replayed), replayed
    assert copied == [0, 1]  # the torch RoPE returns new q and k; v is read where the projection wrote it
    compare_outputs("emulated piecewise prefill graphs against eager", got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("hybrid", [True, False], ids=["gemma3-sliding", "llama"])
def test_replayed_prefill_steps_give_the_eager_outputs(hybrid, monkeypatch):
    model_dir = hybrid_model() if hybrid else tiny_model()
    got, want, replayed, copied = graphed_and_eager(model_dir, "full", monkeypatch)
    assert replayed_sizes_are_right(replayed), replayed
    assert copied == []  # RoPE's kernel rotates q and k in place: the cuts copy nothing
    compare_outputs("piecewise prefill graphs against eager", got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", [
    "quest:token_budget=64,skip_layers=0,page_size=16",  # its KV-write hook keeps per-page key bounds
    "xattn:threshold=0.5,block_size=64,stride=4,dense_below=0",  # a sparse prefill
], ids=["quest", "xattn"])
def test_a_sparse_policy_runs_between_the_replays(policy, monkeypatch):
    name = policy.split(":")[0]
    if name not in get_plugins().registry.sparse_policies:
        pytest.skip(f"needs the nanovllm-{name} plugin")
    got, want, replayed, _ = graphed_and_eager(tiny_model(), policy, monkeypatch)
    assert replayed
    compare_outputs(f"piecewise prefill graphs against eager, {name}", got, want)
