"""The sparse-policy conformance kit: checks that a policy keeps the contract of :mod:`nanovllm.sparse`.

Give it a selection whose budget covers every block (e.g. ``"window:sink_blocks=64,recent_blocks=64"``);
with such options a policy must give exactly the ``full`` policy's greedy tokens and log-probabilities in
every scheduling situation. Give it also a selection with a small budget (``small_budget=``): the
``small_budget`` check runs the policy's sparse code, checks every selection and the per-block metadata,
and compares each layer's output with the ``torch`` backend's attention over exactly the blocks the policy
selected (a policy that selects no blocks: with a weighted average of its sequence's values). In a policy
distribution's own tests::

    import pytest
    from nanovllm.conformance import cases, run_case

    @pytest.mark.parametrize("case", cases(), ids=str)
    def test_conformance(case):
        run_case(case, "mypolicy:budget=100000", small_budget="mypolicy:budget=2")

``cases()`` lists every check for the CPU with the ``torch`` backend, and with ``triton`` when CUDA is
there, each with the KV cache on the device and again offloaded to host memory (the same policy code must
give the same results on both), and the scheduling checks again on a hybrid model (sliding-window layers
beside global ones, each keeping only its window: the policy runs on the global layers), on the device and
offloaded (the global layers in the host pool, the windows in a GPU pool of their own), and the scheduling
checks again over an 8-bit KV cache (``kv_cache_dtype="fp8_e4m3"``; skipped for a policy that does not list it
in ``supported_kv_cache_dtypes``), against the ``full`` policy over the same 8-bit cache. The scenario,
``metadata`` and ``small_budget`` checks also check every block id the per-block hooks and the selections'
contexts hand a policy (:class:`BlockIdChecker`): a block of the store its metadata is sized for, never the
null block. A check that does not apply (CUDA graphs on the CPU, metadata of a policy that keeps none,
``small_budget`` without a small-budget selection) raises :class:`unittest.SkipTest`, which pytest reports
as skipped. A broken rule raises ``AssertionError`` naming the scenario, the request and what differs. The
kit builds a tiny random Llama model once per process (no download) unless ``model_dir`` is given, and for
the hybrid cases a tiny random Gemma 3 (the ``nanovllm-gemma3`` plugin; skipped without it).
"""

from __future__ import annotations

import contextlib
import functools
import random
import tempfile
import unittest
from typing import Any

import attrs
import torch

from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.kv import KVWrite
from nanovllm.policies.full import FullAttentionPolicy
from nanovllm.policy import PolicyContext, PolicyContractError, PolicyHooks, selection_problem

CHECKS = (
    "prefill",
    "decode",
    "chunked_prefill",
    "prefix_cache",
    "preemption",
    "mixed_lengths",
    "selection_contract",
    "metadata",
    "small_budget",
    "cuda_graphs",
    "no_host_sync",
)
BLOCK_SIZE = 4  # small blocks, so short prompts span many of them
ATOL = 2e-4  # float32 everywhere: the policy's kernels and the dense ones differ only in rounding


# With KV offload: load slots of this many head blocks (one KV head of one block), so that a layer's reads
# are cut into several pieces; few sequences at once, so that every piece holds a block of each.
OFFLOAD_SLOT_HEAD_BLOCKS = 24
OFFLOAD_MAX_NUM_SEQS = 8
# The checks run again on the hybrid model: those whose scheduling moves a window group's blocks
HYBRID_CHECKS = ("decode", "chunked_prefill", "prefix_cache", "preemption", "small_budget", "cuda_graphs")


@attrs.define(frozen=True)
class Case:
    check: str
    device: str
    backend: str
    offload: bool = False  # KV in the host pool, streamed through the offload engine's load slots
    hybrid: bool = False  # on the hybrid model (hybrid_model), not the tiny Llama
    kv_cache_dtype: str = "auto"  # the engine option: "fp8_e4m3" keeps K and V as 8-bit floats

    def __str__(self) -> str:
        return (f"{self.check}-{self.device}-{self.backend}" + ("-offload" if self.offload else "")
                + ("-hybrid" if self.hybrid else "")
                + (f"-{self.kv_cache_dtype}" if self.kv_cache_dtype != "auto" else ""))


def cases() -> list[Case]:
    """Every check on the CPU with ``torch``, and on CUDA with ``triton`` when a GPU is there; each again
    with KV offload; ``HYBRID_CHECKS`` on the hybrid model, with and without offload (listed first); and the
    scheduling checks over an 8-bit KV cache."""
    envs = [("cpu", "torch")]
    if torch.cuda.is_available():
        envs.append(("cuda", "triton"))
    hybrid = [Case(check, device, backend, offload, hybrid=True)
              for device, backend in envs for offload in (False, True) for check in HYBRID_CHECKS]
    eight_bit = [Case(check, device, backend, kv_cache_dtype="fp8_e4m3")
                 for device, backend in envs for check in SCENARIOS]
    return hybrid + eight_bit + [
        Case(check, device, backend, offload)
        for device, backend in envs
        for offload in (False, True)
        for check in CHECKS
    ]


@functools.cache
def tiny_model() -> str:
    """A tiny random Llama (GQA 4q/2kv, head size 32 as the triton backend needs, 3 layers), written once
    per process."""
    from nanovllm.testing import tiny_model_dir

    path = tempfile.mkdtemp(prefix="nanovllm-conformance-")
    return str(tiny_model_dir(path, "LlamaForCausalLM", num_hidden_layers=3, hidden_size=128,
                              intermediate_size=256))


@functools.cache
def hybrid_model() -> str:
    """A tiny random Gemma 3 (``nanovllm.testing``'s: four of six layers slide over a window of 32 tokens,
    two attend globally), written once per process; skips the test without the Gemma 3 plugin."""
    from nanovllm.plugins import get_plugins
    from nanovllm.testing import tiny_model_dir

    if "Gemma3ForCausalLM" not in get_plugins().registry.model_families:
        raise unittest.SkipTest("the hybrid model needs the nanovllm-gemma3 plugin")
    return str(tiny_model_dir(tempfile.mkdtemp(prefix="nanovllm-conformance-"), "Gemma3ForCausalLM"))


def policy_engine(policy: str, device: str, block_size: int, offload: bool = False, **options: Any):
    """A small float32 engine on the kit's tiny model under ``policy`` (a sparse-policy selection,
    ``name:key=value,...;name2:...``), as policies' engine tests use it: eager, 4 sequences, ``max_model_len``
    512, the torch backend on the CPU and triton elsewhere, the KV cache on the device (8 MiB) or with
    ``offload`` in host memory; ``options`` override any of these. Skips the test when a policy it names is
    not registered (its distribution is not installed)."""
    from nanovllm import LLM
    from nanovllm.plugins import get_plugins

    registered = get_plugins().registry.sparse_policies
    for name in (selection.split(":")[0].strip() for selection in policy.split(";")):
        if name not in registered:
            raise unittest.SkipTest(f"sparse policy {name!r} is not registered: its distribution is not "
                                    "installed")
    settings: dict[str, Any] = dict(device=device, dtype="float32", block_size=block_size, max_model_len=512,
                                    enforce_eager=True, max_num_seqs=4,
                                    attention_backend="torch" if device == "cpu" else "triton")
    if offload:
        settings.update(kv_offloading_size=0.01, kv_offloading_buffer_size=0.004)
    else:
        settings["kv_cache_memory"] = 2**23
    return LLM(tiny_model(), sparse_policy=policy, **(settings | options))


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


def _kv_shape(model_dir: str) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of the model."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), head_dim


def _kv_bytes(model_dir: str, tokens: int, global_only: bool = False) -> int:
    """``kv_cache_memory`` that holds ``tokens`` tokens of the model's KV in float32 (with ``global_only``,
    of its full-attention layers alone: what a hybrid model keeps in the host pool under offload)."""
    import json
    from pathlib import Path

    layers, kv_heads, head_dim = _kv_shape(model_dir)
    kinds = json.loads((Path(model_dir) / "config.json").read_text()).get("layer_types")
    if global_only and kinds:
        layers = kinds.count("full_attention")
    return tokens * 2 * layers * kv_heads * head_dim * 4


def _engine(case: Case, model_dir: str, policy: Any, observers=(), **overrides):
    from nanovllm import LLM

    options = dict(
        device=case.device, attention_backend=case.backend, dtype="float32", block_size=BLOCK_SIZE,
        max_model_len=512, kv_cache_tokens=4096, max_num_batched_tokens=512, enforce_eager=True,
        kv_cache_dtype=case.kv_cache_dtype,
    )
    options.update(overrides)
    tokens = options.pop("kv_cache_tokens")
    kv_bytes = _kv_bytes(model_dir, tokens) // (4 if case.kv_cache_dtype != "auto" else 1)  # float32 or 8 bits
    if case.offload:  # the same KV budget, in the host pool
        head_block_bytes = 2 * BLOCK_SIZE * _kv_shape(model_dir)[2] * 4
        options.update(kv_offloading_size=kv_bytes / 2**30, max_num_seqs=OFFLOAD_MAX_NUM_SEQS,
                       kv_offloading_buffer_size=2 * OFFLOAD_SLOT_HEAD_BLOCKS * head_block_bytes / 2**30)
        if case.hybrid:  # as many tokens of the global layers in the pool; the windows' pool on the device
            options.update(kv_offloading_size=_kv_bytes(model_dir, tokens, global_only=True) / 2**30,
                           kv_cache_memory=kv_bytes)
    else:
        options["kv_cache_memory"] = kv_bytes
    return LLM(model_dir, sparse_policy=policy, observers=observers, **options)


def _params(max_tokens: int, prompt_logprobs: bool = True):
    from nanovllm import SamplingParams

    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3,
        prompt_logprobs=3 if prompt_logprobs else None,
    )


# Each scenario: engine overrides, then a list of generate() calls (prompt lengths, max_tokens, seed, prompt
# logprobs). Requests with prompt logprobs take no prefix-cache hits, so the prefix scenario asks for none.
SCENARIOS: dict[str, tuple[dict, list[tuple[list[int], int, int, bool]]]] = {
    "prefill": ({}, [([5, 23, 61, 130], 1, 1, True)]),
    "decode": ({}, [([3, 40, 97], 24, 2, True)]),
    "chunked_prefill": ({"max_num_batched_tokens": 16}, [([70, 131, 9], 6, 3, True)]),
    "prefix_cache": ({}, [([96], 3, 4, False), ([96, 96], 8, 4, False)]),
    # 192 tokens of KV (fewer where the policy keeps per-block metadata in the same budget) for four
    # requests of up to 90: they preempt one another
    "preemption": ({"kv_cache_tokens": 192, "max_model_len": 128, "max_num_batched_tokens": 64},
                   [([30, 45, 60, 25], 30, 5, True)]),
    "mixed_lengths": ({"max_num_batched_tokens": 48}, [([3, 17, 64, 130, 1, 33], 12, 6, True)]),
}
# On the hybrid model (KV budgets in tokens of every layer): window groups need less, so the same requests
# preempt one another in a smaller budget that still holds one sequence of every group
HYBRID_OVERRIDES = {"preemption": {"kv_cache_tokens": 144, "max_num_batched_tokens": 16}}
# Over an 8-bit cache a block's float32 metadata weighs as much as its K and V: a policy that keeps it holds
# half the tokens in the same budget, which must still hold one sequence of max_model_len
EIGHT_BIT_OVERRIDES = {"preemption": {"max_model_len": 96}}


def _generate(llm: Any, prompts: list[list[int]], params: Any) -> list:
    """``llm.generate``; a request that a failing step ended (finish reason ``"error"``) fails the check with
    its error."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outputs):
        if out.outputs[0].finish_reason == "error":
            raise AssertionError(f"request {i} (prompt of {len(out.prompt_token_ids)} tokens) ended with an "
                                 f"error: {getattr(out.outputs[0], 'error', None)}")
    return outputs


def _run_scenario(case: Case, model_dir: str, policy: Any, scenario: str, observers=()) -> tuple[list, Any]:
    overrides, calls = SCENARIOS[scenario]
    if case.hybrid:
        overrides = overrides | HYBRID_OVERRIDES.get(scenario, {})
    if case.kv_cache_dtype != "auto":
        overrides = overrides | EIGHT_BIT_OVERRIDES.get(scenario, {})
    ids = BlockIdChecker()
    llm = _engine(case, model_dir, policy, [*observers, ids], **overrides)
    ids.null_block = llm.scheduler.block_manager.null_block
    outputs = []
    for lengths, max_tokens, seed, prompt_lp in calls:
        prompts = _prompts(lengths, seed) if scenario != "prefix_cache" else _prefix_prompts(lengths, seed)
        outputs.extend(_generate(llm, prompts, _params(max_tokens, prompt_lp)))
    # the scenario's premise, so that a change of settings cannot make it test nothing
    if scenario == "preemption":
        assert llm.scheduler.num_preemptions > 0, "preemption: no request was preempted"
    if scenario == "prefix_cache":
        assert any(o.num_cached_tokens for o in outputs), "prefix_cache: no prefix-cache hit"
    return outputs, llm


def _prefix_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts that share one long prefix and differ in their tails."""
    shared = _prompts([max(lengths)], seed)[0]
    return [shared[:n] + _prompts([5], seed + i)[0] for i, n in enumerate(lengths)]


@functools.cache
def _full_outputs(device: str, backend: str, model_dir: str, scenario: str, hybrid: bool = False,
                  kv_cache_dtype: str = "auto") -> list:
    """The ``full`` policy's outputs of a scenario, once per process."""
    case = Case(scenario, device, backend, hybrid=hybrid, kv_cache_dtype=kv_cache_dtype)
    return _run_scenario(case, model_dir, "full", scenario)[0]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= ATOL + 1e-4 * abs(b)


def _compare_logprob_rows(where: str, got: list, want: list, tokens: list[int]) -> None:
    assert (got is None) == (want is None), f"{where}: log-probabilities present in one run only"
    if got is None:
        return
    assert len(got) == len(want), f"{where}: {len(got)} log-probability rows, full has {len(want)}"
    for pos, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert g is None, f"{where}: position {pos} has log-probabilities, full has none"
            continue
        token = tokens[pos]
        assert _close(g[token].logprob, w[token].logprob), (
            f"{where}: position {pos}, token {token}: logprob {g[token].logprob:.6f}, "
            f"full {w[token].logprob:.6f}"
        )
        gv = sorted((lp.logprob for lp in g.values()), reverse=True)
        wv = sorted((lp.logprob for lp in w.values()), reverse=True)
        assert len(gv) == len(wv) and all(map(_close, gv, wv)), (
            f"{where}: position {pos}: top log-probabilities {gv} differ from full {wv}"
        )


def compare_outputs(scenario: str, got: list, want: list) -> None:
    """Greedy tokens equal and log-probabilities (prompt and generated) equal within float32 rounding."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        where = f"{scenario}: request {i} (prompt of {len(w.prompt_token_ids)} tokens)"
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, (
            f"{where}: tokens {g.outputs[0].token_ids} differ from full {w.outputs[0].token_ids}"
        )
        _compare_logprob_rows(where + " prompt", g.prompt_logprobs, w.prompt_logprobs, w.prompt_token_ids)
        _compare_logprob_rows(where + " output", g.outputs[0].logprobs, w.outputs[0].logprobs,
                              w.outputs[0].token_ids)


# -- observers used by the checks -------------------------------------------------------------------------


class SelectionChecker:
    """An observer that checks every selection the engine receives against the contract's rules (those
    of the engine's own check, :func:`nanovllm.policy.selection_problem`), whatever
    ``NANOVLLM_CHECK_SELECTIONS`` says, and counts them per phase. It reads the selection on the host, so
    an engine with it decodes eagerly."""

    def __init__(self) -> None:
        self.calls = {"prefill": 0, "decode": 0}

    def on_blocks_selected(self, ctx: PolicyContext, block_indices: torch.Tensor) -> None:
        phase = "prefill" if ctx.is_prefill else "decode"
        problem = selection_problem(ctx, block_indices)
        assert problem is None, f"select_blocks (layer {ctx.layer_id}, {phase}) {problem}"
        self.calls[phase] += 1


class BlockIdChecker:
    """An observer that checks every block id the per-block hooks hand a policy: those of
    ``on_blocks_allocated``, the written rows' blocks and the step's block tables in ``on_kv_write``, and the
    history's blocks in each selection's context. Each must name a block of the store whose ``num_blocks``
    the policies' metadata is sized for (``initialize``), and none the null block (``null_block``: the kit
    sets it once the engine is built), which no policy layer reads or writes. A block id of another pool
    would update or read another block's metadata: on the GPU, past the end of it. It reads the ids on the
    host, so an engine with it decodes eagerly."""

    def __init__(self) -> None:
        self.num_blocks: int | None = None
        self.null_block: int | None = None

    def initialize(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device) -> None:
        self.num_blocks = num_blocks

    def _check(self, where: str, ids: torch.Tensor) -> None:
        ids = ids.flatten().tolist()
        bad = sorted({b for b in ids if not 0 <= b < self.num_blocks or b == self.null_block})
        assert not bad, (f"{where}: block ids {bad[:8]} are not blocks of the store's {self.num_blocks} (the "
                         f"policies' metadata rows; null block {self.null_block})")

    def on_blocks_allocated(self, block_ids: torch.Tensor) -> None:
        self._check("on_blocks_allocated", block_ids)

    def on_kv_write(self, write: KVWrite) -> None:
        where = f"on_kv_write (layer {write.layer_id})"
        slots = write.slot_mapping
        self._check(f"{where}: the rows' blocks", slots[slots >= 0] // write.block_size)
        for name, phase in (("decode", write.step.decode), ("prefill", write.step.prefill)):
            if phase is not None:  # a row's table: -1 padded; the null block only past a window
                tables = phase.block_tables
                named = tables[(tables >= 0) & (tables != self.null_block)]
                self._check(f"{where}: the {name} block tables", named)
                assert bool((tables >= -1).all()), f"{where}: the {name} block tables hold ids below -1"

    def on_blocks_selected(self, ctx: PolicyContext, block_indices: torch.Tensor) -> None:
        tables = ctx.meta.block_tables
        logical = torch.arange(tables.shape[1], device=tables.device)
        history = logical[None, :] < ctx.num_history_blocks[:, None]
        self._check(f"the history blocks of the context of layer {ctx.layer_id}", tables[history])


class FillRecorder:
    """How many tokens each physical block holds, the position of its first token and the layers that wrote
    it (on a hybrid model, those of the KV cache group holding it), from the KV-write hook (reset on
    reallocation)."""

    def __init__(self) -> None:
        self.fill: dict[int, int] = {}
        self.start: dict[int, int] = {}
        self.layers: dict[int, set[int]] = {}

    def on_blocks_allocated(self, block_ids: torch.Tensor) -> None:
        for b in block_ids.tolist():
            self.fill[b] = 0
            self.layers[b] = set()

    def on_kv_write(self, write: KVWrite) -> None:
        rows = (write.block_ids.tolist(), write.block_fill().tolist(), write.positions.tolist())
        for b, n, pos in zip(*rows, strict=True):
            if b >= 0:
                self.fill[b] = max(self.fill.get(b, 0), n)
                self.start[b] = pos - pos % write.block_size
                self.layers.setdefault(b, set()).add(write.layer_id)


# -- the checks -----------------------------------------------------------------------------------------


def run_case(
    case: Case, policy: str | dict, model_dir: str | None = None, small_budget: str | dict | None = None
) -> None:
    """Run one check of the kit for ``policy`` (a selection whose budget covers every block); the
    ``small_budget`` check runs ``small_budget`` instead (the same policy with a budget below the prompts'
    blocks: a few blocks, and options that keep every layer sparse) and skips without it."""
    if case.device == "cuda" and not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA device")
    if case.kv_cache_dtype not in _supported_kv_cache_dtypes(policy):
        raise unittest.SkipTest(f"the policy does not list kv_cache_dtype {case.kv_cache_dtype!r} in "
                                "supported_kv_cache_dtypes")
    model_dir = model_dir or (hybrid_model() if case.hybrid else tiny_model())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's work is too small to share: more threads only spin
    try:
        if case.check in SCENARIOS:
            got, _ = _run_scenario(case, model_dir, policy, case.check)
            compare_outputs(case.check, got, _full_outputs(case.device, case.backend, model_dir, case.check,
                                                          case.hybrid, case.kv_cache_dtype))
        elif case.check == "selection_contract":
            _check_selection_contract(case, model_dir, policy)
        elif case.check == "metadata":
            _check_metadata(case, model_dir, policy)
        elif case.check == "small_budget":
            _check_small_budget(case, model_dir, small_budget)
        elif case.check == "cuda_graphs":
            _check_cuda_graphs(case, model_dir, policy)
        elif case.check == "no_host_sync":
            _check_no_host_sync(case, model_dir, policy)
        else:
            raise ValueError(f"unknown check {case.check!r}; the checks are {', '.join(CHECKS)}")
    except PolicyContractError as exc:  # the engine's own check of every selection
        raise AssertionError(f"{case.check}: {exc}") from exc
    finally:
        torch.set_num_threads(threads)


def _supported_kv_cache_dtypes(policy: str | dict) -> set[str]:
    """The ``kv_cache_dtype`` options every policy of the selection ``policy`` lists."""
    from nanovllm.plugins import get_plugins
    from nanovllm.selection import resolve_policies

    plan = resolve_policies(policy, get_plugins())
    return {"auto"} | set.intersection(*(set(getattr(p.cls, "supported_kv_cache_dtypes", ("auto",)))
                                         for p in (plan.prefill, plan.decode)))


def _check_selection_contract(case: Case, model_dir: str, policy: Any) -> None:
    checker = SelectionChecker()
    got, llm = _run_scenario(case, model_dir, policy, "mixed_lengths", observers=[checker])
    want = _full_outputs(case.device, case.backend, model_dir, "mixed_lengths", case.hybrid)
    compare_outputs("selection_contract", got, want)
    for phase in ("prefill", "decode"):
        if getattr(llm.runner.hooks, phase).requires_block_selection:
            assert checker.calls[phase] > 0, f"{phase}: select_blocks was never called"
        else:
            assert checker.calls[phase] == 0, f"{phase}: the policy selects nothing, yet selections were seen"
    if not any(checker.calls.values()):
        raise unittest.SkipTest("the policy selects no blocks (requires_block_selection=False)")


def _check_metadata(case: Case, model_dir: str, policy: Any) -> None:
    """Metadata kept step by step (prefix hits, preemption, reallocation) equals one pass over the cache."""
    fills, ids = FillRecorder(), BlockIdChecker()
    llm = _engine(case, model_dir, policy, [fills, ids], **SCENARIOS["preemption"][0])
    ids.null_block = llm.scheduler.block_manager.null_block
    _generate(llm, _prompts([30, 45, 60, 25], 5), _params(30, False))
    assert llm.scheduler.num_preemptions > 0, "the metadata workload did not preempt"
    _generate(llm, _prefix_prompts([40], 7), _params(10, False))
    prompts = _prefix_prompts([40, 40], 7)[1:] + _prompts([20], 9)
    shared = _generate(llm, prompts, _params(10, False))
    assert shared[0].num_cached_tokens > 0, "no prefix-cache hit"
    if not _compare_metadata("metadata", llm, fills):
        raise unittest.SkipTest("the policy keeps no per-block metadata (block_metadata returns None)")


def _compare_metadata(check: str, llm: Any, fills: FillRecorder) -> int:
    """Compare each policy's kept metadata of every written block with a fresh instance's recomputation
    from the cache; the number of policies that keep metadata."""
    runner = llm.runner
    blocks = sorted(b for b, n in fills.fill.items() if n > 0)
    ids = torch.tensor(blocks, dtype=torch.long, device=runner.device)

    def written_by(layer_id: int) -> list[int]:  # a hybrid model's layers write only their group's blocks
        return [b for b in blocks if layer_id in fills.layers.get(b, ())]

    # under offload a hybrid model's window layers keep their KV in a pool no hook sees: nothing to compare
    layers = [layer for layer in runner.attention_layers if written_by(layer.layer_id)]

    checked = 0
    for policy_obj in runner.hooks.policies:
        if policy_obj.block_metadata(0, ids) is None:
            continue
        twin = type(policy_obj)(policy_obj.config)
        twin.initialize(len(runner.attention_layers), runner.num_kv_heads, runner.head_dim, runner.num_blocks,
                        runner.block_size, runner.dtype, runner.device)
        twin.on_blocks_allocated(ids)
        for layer in layers:
            mine = written_by(layer.layer_id)
            counts, starts = [fills.fill[b] for b in mine], [fills.start[b] for b in mine]
            caches = (layer.k_cache, layer.v_cache)
            twin.on_kv_write(KVWrite.of_blocks(layer.layer_id, *caches, mine, counts, starts))
        for layer in layers:
            mine = torch.tensor(written_by(layer.layer_id), dtype=torch.long, device=runner.device)
            # compared as float32: metadata of any dtype (float8 has no arithmetic on the CPU)
            kept = policy_obj.block_metadata(layer.layer_id, mine).float()
            fresh = twin.block_metadata(layer.layer_id, mine).float()
            same = torch.allclose(kept, fresh, rtol=1e-5, atol=1e-6, equal_nan=True)
            assert same, (
                f"{check}: layer {layer.layer_id}: the metadata {type(policy_obj).__name__} kept through "
                f"on_kv_write / on_blocks_allocated differs from a recomputation over the cache "
                f"(max difference {(kept - fresh).abs().nan_to_num().max().item():.3g})"
            )
        checked += 1
    return checked


# Prompts of up to 61 blocks, prefilled in chunks beside decodes, then decoded across block boundaries.
SMALL_BUDGET_SCENARIO = ({"max_num_batched_tokens": 64}, ([3, 17, 90, 242, 40], 10, 11))


def _check_small_budget(case: Case, model_dir: str, policy: Any) -> None:
    """The policy's sparse code: every selection keeps the contract, every layer's output is attention
    over exactly what the policy selected, the output differs from dense attention somewhere (the budget
    is small), and the metadata equals a recomputation from the cache."""
    if policy is None:
        raise unittest.SkipTest("no small-budget selection: pass run_case(..., small_budget='name:...') with "
                                "a budget of a few blocks to run the policy's sparse code")
    selections, fills = SelectionChecker(), FillRecorder()
    overrides, (lengths, max_tokens, seed) = SMALL_BUDGET_SCENARIO
    ids = BlockIdChecker()
    llm = _engine(case, model_dir, policy, [selections, fills, ids], **overrides)
    ids.null_block = llm.scheduler.block_manager.null_block
    llm.runner.hooks.check_selections = True
    reference = AttentionReference(llm.runner.hooks)
    if not reference.phases:
        raise unittest.SkipTest("the small-budget selection runs full attention in both phases")
    _generate(llm, _prompts(lengths, seed), _params(max_tokens, False))
    for phase in reference.phases:
        if getattr(llm.runner.hooks, phase).requires_block_selection:
            assert selections.calls[phase] > 0, f"small_budget: {phase}: select_blocks was never called"
    assert reference.sparse_calls > 0, (
        f"small_budget: in {reference.calls} layer calls the policy's output equals dense attention: "
        f"{policy!r} attends to everything here; give it a budget of a few blocks, and options that keep "
        "every layer and chunk sparse"
    )
    _compare_metadata("small_budget", llm, fills)


class AttentionReference:
    """Wraps the compute hook of each phase an engine runs with a policy other than ``full``, and checks
    each output against the ``torch`` backend: attention over exactly ``ctx.selected_blocks`` (prefill:
    merged with the chunk itself) where the policy selects blocks; where it does not, a weighted average
    of its sequence's values (every output channel between their minimum and maximum). Counts the calls
    whose output differs from dense attention."""

    def __init__(self, hooks: PolicyHooks) -> None:
        self.torch = TorchBackend()
        self.calls = self.sparse_calls = 0
        self.phases = [p for p in ("prefill", "decode")
                       if not isinstance(getattr(hooks, p), FullAttentionPolicy)]
        for phase in self.phases:  # the engine calls the policy's method: wrap it on the instance
            policy, compute = getattr(hooks, phase), f"compute_chunked_{phase}"
            setattr(policy, compute, self._wrap(getattr(policy, compute), type(policy)))

    def _wrap(self, compute, policy: type):
        def checked(*args):
            out = compute(*args)
            self._check(policy, out, *args)
            return out

        return checked

    def _check(self, policy: type, out: torch.Tensor, q: torch.Tensor, *args) -> None:
        ctx: PolicyContext = args[-1]
        k, v = args[:2] if ctx.is_prefill else (None, None)
        ctx.kv.wait_writes()  # the reference below reads the store's paged view itself
        hook = f"{policy.__qualname__}.compute_chunked_{'prefill' if ctx.is_prefill else 'decode'}"
        where = f"small_budget: layer {ctx.layer_id}, {hook}"
        assert out.shape == q.shape and out.dtype == q.dtype, (
            f"{where} returned {out.dtype} {list(out.shape)}; expected the query's {q.dtype} {list(q.shape)}"
        )
        if ctx.selected_blocks is not None:
            want = self._over_selection(ctx, q, k, v)
            assert torch.allclose(out.float(), want.float(), atol=ATOL, rtol=1e-4), (
                f"{where}: the output differs from attention over the blocks select_blocks returned (max "
                f"difference {(out.float() - want.float()).abs().max().item():.3g}): it attends to other keys"
            )
        else:
            self._check_average(where, ctx, out)
        self.calls += 1
        dense = self._dense(ctx, q, k, v)
        self.sparse_calls += not torch.allclose(out.float(), dense.float(), atol=ATOL, rtol=1e-4)

    def _over_selection(self, ctx: PolicyContext, q, k, v) -> torch.Tensor:
        caches = (ctx.k_cache, ctx.v_cache, ctx.meta)
        history = self.torch.attend_blocks(q, *caches, ctx.selected_blocks, ctx.history_lens, ctx.scale)
        if not ctx.is_prefill:
            return history[0]
        return self.torch.merge(*history, *self.torch.attend_chunk(q, k, v, ctx.meta, ctx.scale))[0]

    def _dense(self, ctx: PolicyContext, q, k, v) -> torch.Tensor:
        caches = (ctx.k_cache, ctx.v_cache, ctx.meta, ctx.scale)
        return self.torch.prefill(q, k, v, *caches) if ctx.is_prefill else self.torch.decode(q, *caches)

    @staticmethod
    def _check_average(where: str, ctx: PolicyContext, out: torch.Tensor) -> None:
        meta, size = ctx.meta, ctx.block_size
        logical = torch.arange(meta.block_tables.shape[1], device=out.device, dtype=torch.int32)
        written = (meta.context_lens[:, None] + size - 1) // size
        values = ctx.read_blocks(torch.where(logical < written, logical, -1))[1].float()  # [S, W, bs, Hkv, D]
        position = logical[:, None] * size + torch.arange(size, device=out.device)
        unseen = ~(position[None] < meta.context_lens[:, None, None])[..., None, None]
        low = values.masked_fill(unseen, float("inf")).amin((1, 2))  # [S, Hkv, D]
        high = values.masked_fill(unseen, float("-inf")).amax((1, 2))
        seq = torch.repeat_interleave(torch.arange(meta.num_seqs, device=out.device), meta.query_lens.long(),
                                      output_size=out.shape[0])
        group = out.shape[1] // low.shape[1]
        low, high = (b[seq].repeat_interleave(group, dim=1) for b in (low, high))  # [T, H, D]
        inside = (out.float() >= low - ATOL) & (out.float() <= high + ATOL)
        assert bool(inside.all()), (
            f"{where}: an output lies outside the range of its sequence's values (or is not finite): "
            "attention's output is a weighted average of them"
        )


def _check_cuda_graphs(case: Case, model_dir: str, policy: Any) -> None:
    if case.device != "cuda":
        raise unittest.SkipTest("CUDA graphs need a CUDA device")
    llm = _engine(case, model_dir, policy, enforce_eager=False)
    if not llm.runner.cuda_graphs.graphs:
        if not llm.runner.kv.can_capture_decode(llm.runner.hooks.decode.requires_block_selection):
            raise unittest.SkipTest("this KV store captures only decode steps that select on the device")
        if llm.runner.hooks.cuda_graph_safe_on(llm.runner.kv):
            raise AssertionError("the policy declares cuda_graph_safe, yet no decode graph was captured")
        raise unittest.SkipTest("the policy is not cuda_graph_safe: decode runs eagerly")
    prompts = _prompts([3, 40, 97, 12], 8)
    graphed = _generate(llm, prompts, _params(24))
    eager = _generate(_engine(case, model_dir, policy), prompts, _params(24))
    compare_outputs("cuda_graphs (graphs against eager)", graphed, eager)


def _check_no_host_sync(case: Case, model_dir: str, policy: Any) -> None:
    """Decode steps under CUDA graphs queue their work and return without waiting for the GPU. The engine
    launches step N+1 before it reads step N's tokens; a sync in a step (``.item()``, ``.tolist()`` of a
    device tensor, a copy from pageable memory such as ``x[ids] = 0.0``) drains that pipeline, and the GPU
    then idles while the host launches the next graph. Steps cross block boundaries, so the allocation hook
    runs too. The engine's own read-back of a step's tokens waits on an event, which this does not count."""
    if case.device != "cuda":
        raise unittest.SkipTest("CUDA graphs need a CUDA device")
    llm = _engine(case, model_dir, policy, enforce_eager=False)
    if not llm.runner.cuda_graphs.graphs:
        raise unittest.SkipTest("no decode graph was captured: decode runs eagerly (the cuda_graphs check)")
    params = _params(8 * BLOCK_SIZE, prompt_logprobs=False)
    seqs = [llm.add_request(prompt, params) for prompt in _prompts([3, 40, 97, 12], 10)]
    while any(s.num_completion_tokens < 2 for s in seqs):  # every prompt prefilled, decodes under way
        llm.step()
    with host_syncs_fail():
        for step in range(3 * BLOCK_SIZE):
            llm.step()  # a sync raises inside the step, which ends the requests it ran with that error
            failed = next((s for s in seqs if s.error is not None), None)
            if failed is not None:
                raise AssertionError(f"no_host_sync: decode step {step} waited for the GPU: {failed.error}")
    assert all(not s.is_finished for s in seqs), "no_host_sync: a request finished inside the checked steps"


@contextlib.contextmanager
def host_syncs_fail():
    """Inside, a CUDA operation that waits for the GPU raises ``RuntimeError`` (PyTorch's sync-debug error
    mode). The GPU's earlier work is finished first, so only what runs inside counts."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
