"""The runner's start-up warm-up: its steps cover the kernel variants that later eager steps would otherwise
compile inside users' requests (fresh long chunks alone and together, steps of few rows for the small-batch
matmul, the logits of the rows the engine samples, the sampler), and it writes nothing and draws nothing from
the run's random streams. The engine warms up on CUDA only; here its steps run on the CPU (torch backend)."""

from __future__ import annotations

import random

import pytest
import torch

from nanovllm.attention.metadata import get_forward_context
from nanovllm.engine.warm_up import warm_up, warm_up_steps
from nanovllm.kernel_sizes import CHAINED_LAUNCH_MAX_ROWS
from nanovllm.layers.gemv import MAX_ROWS, row_bucket


def gemv_keys(rows: set[int]) -> set[tuple]:
    """The small-batch matmul's compile keys that ``rows`` (counts of rows of x) reach: its configuration
    is per bucket of rows, and Triton specialises the row count where it is 1 or a multiple of 16."""
    return {(row_bucket(m), m == 1, m % 16 == 0) for m in rows if m <= MAX_ROWS}


@pytest.mark.parametrize("max_model_len,block_size,max_num_seqs",
                         [(4096, 16, 256), (32833, 256, 8), (100, 16, 16), (64, 16, 1), (512, 16, 3)])
def test_the_steps_cover_what_later_steps_would_compile(max_model_len, block_size, max_num_seqs):
    steps = warm_up_steps(max_model_len, block_size, max_num_seqs)
    for step in steps:
        assert max(step.chunks, default=0) + step.history <= max_model_len
        assert step.rows == step.decodes + sum(step.chunks)
        assert len(step.sample_rows) == step.decodes + len(step.chunks)
        assert step.sample_rows[-1] == step.rows - 1
    # one fresh sequence's chunk, as long as the model allows up to past the short-chunk kernel's 64
    fresh = [s.chunks[0] for s in steps if len(s.chunks) == 1 and s.history == 0]
    assert max(fresh) >= min(max_model_len, 65)
    # and several in one step, each as long (one alone takes SDPA's path on CUDA, several the Triton kernel)
    packed = [min(s.chunks) for s in steps if len(s.chunks) > 1 and s.history == 0]
    assert max(packed) >= min(max_model_len, 65)
    # a chunk after a history that reaches max_model_len, and a prompt cached but for its last token
    assert any(max(s.chunks) + s.history == max_model_len for s in steps if s.chunks)
    assert any(s.rows == 1 and s.chunks == (1,) and s.history for s in steps)
    # every variant of the small-batch matmul, in the layers (all rows) and the LM head (the sampled rows:
    # at most max_num_seqs, as in any step; the first steps have always had 3)
    assert gemv_keys({s.rows for s in steps}) == gemv_keys(set(range(1, MAX_ROWS + 1)))
    small = [len(s.sample_rows) for s in steps if s.rows <= MAX_ROWS]
    assert max(small) <= max_num_seqs
    assert gemv_keys(set(small)) == gemv_keys(set(range(1, min(max_num_seqs, MAX_ROWS) + 1)))
    # the decode kernels unchained: more decode rows than launch chained, where the batch allows them
    unchained = any(s.decodes > CHAINED_LAUNCH_MAX_ROWS for s in steps)
    assert unchained == (max_num_seqs > CHAINED_LAUNCH_MAX_ROWS + 1)


@pytest.fixture
def runner(tiny_model):
    from nanovllm import LLM

    llm = LLM(tiny_model("Gemma3ForCausalLM"), device="cpu", kv_cache_memory=1 << 23, max_model_len=256,
              block_size=16)
    return llm.runner


def test_the_warm_up_runs_its_steps_samples_last_rows_and_writes_nothing(runner, monkeypatch):
    """Gemma 3's tiny model: hybrid KV (sliding-window layers in a group of their own)."""
    forward, compute_logits, sample = runner.model.forward, runner.model.compute_logits, runner.sampler
    seen: dict[str, list] = {"steps": [], "logits": [], "temperatures": []}

    def recorded_forward(ids, positions):
        meta = get_forward_context()
        seen["steps"].append((meta.num_decode_tokens, ids.shape[0], meta.prefill))
        assert (meta.slot_mapping == -1).all()
        return forward(ids, positions)

    def recorded_logits(hidden):
        seen["logits"].append(hidden.shape[0])
        return compute_logits(hidden)

    def recorded_sample(logits, temperatures, *options):
        assert not options  # the options take the torch path: the kernel is for temperatures alone
        seen["temperatures"].append(temperatures.tolist())
        return sample(logits, temperatures, *options)

    monkeypatch.setattr(runner.model, "forward", recorded_forward)
    monkeypatch.setattr(runner.model, "compute_logits", recorded_logits)
    monkeypatch.setattr(runner, "sampler", recorded_sample)
    gen = torch.Generator().manual_seed(0)
    for layer in runner.attention_layers:
        layer.k_cache.copy_(torch.randn(layer.k_cache.shape, generator=gen))
        layer.v_cache.copy_(torch.randn(layer.v_cache.shape, generator=gen))
    caches = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in runner.attention_layers]
    rng = torch.get_rng_state()

    warm_up(runner)

    steps = warm_up_steps(runner.max_model_len, runner.block_size, runner.config.max_num_seqs)
    assert [(d, n) for d, n, _ in seen["steps"]] == [(s.decodes, s.rows) for s in steps]
    fresh_long = [p for _, _, p in seen["steps"] if p is not None and p.cu_seqlens_q.numel() == 2
                  and p.max_context_len == p.max_query_len > 64]
    assert fresh_long, "no step prefills one fresh sequence's long chunk"
    every_count = list(range(1, runner.config.max_num_seqs + 1))  # the LM head alone, once per row count
    assert seen["logits"] == [len(s.sample_rows) for s in steps] + every_count
    assert len(seen["temperatures"]) == len(steps)
    assert any(0.0 in t and any(x > 0 for x in t) for t in seen["temperatures"])  # greedy and drawn rows
    for layer, (k, v) in zip(runner.attention_layers, caches, strict=True):
        assert (layer.k_cache[0] == 0).all() and (layer.v_cache[0] == 0).all()  # zeroed: what it reads
        assert torch.equal(layer.k_cache[1:], k[1:]) and torch.equal(layer.v_cache[1:], v[1:])
    assert torch.equal(torch.get_rng_state(), rng)


def serve_after_start(llm, vocab: int) -> None:
    """Batches of 1 to 20 sequences, greedy and sampled rows; a prompt cached but for its last token; a
    fresh long prompt alone, and three in one step."""
    from nanovllm import SamplingParams

    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    for batch in range(1, 21):
        params = [SamplingParams(temperature=i % 2, max_tokens=3, ignore_eos=True) for i in range(batch)]
        llm.generate([prompt(5 + i) for i in range(batch)], params, use_tqdm=False)
    cached = prompt(4 * llm.runner.block_size + 1)
    for _ in range(2):  # the second time its four full blocks come from the prefix cache: one row
        llm.generate([cached], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.generate([prompt(300)], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.generate([prompt(100 + i) for i in range(3)], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.gpu
def test_requests_compile_no_kernel_after_the_start(tiny_model):
    """After start-up, eager steps of any batch, sampled or greedy, a prefix-cache hit and fresh long
    prompts compile none of the sampler's kernels, the small-batch matmul's or the prefill kernel. Gemma 3's
    tiny model (sliding-window layers) with a vocabulary the sampler splits; every step eager."""
    from nanovllm import LLM
    from nanovllm.attention import triton_kernels as tk
    from nanovllm.layers import gemv_kernels
    from nanovllm.layers import sampler_kernels as sk

    kernels = [sk._sample_kernel, sk._merge_kernel, gemv_kernels._gemv_kernel,
               gemv_kernels._split_k_sum_kernel, tk._prefill_kernel]

    def compiled() -> dict[str, int]:  # Triton's in-memory cache of compiled variants, per device
        return {kernel.fn.__name__: sum(len(entry[0]) for entry in kernel.device_caches.values())
                for kernel in kernels}

    for kernel in kernels:
        kernel.device_caches.clear()  # earlier tests of this process compiled them already
    vocab = 40_000
    llm = LLM(tiny_model("Gemma3ForCausalLM", vocab_size=vocab), device="cuda", dtype="bfloat16",
              enforce_eager=True, max_model_len=512, block_size=16, kv_cache_memory=1 << 28)
    at_start = compiled()
    assert at_start["_sample_kernel"] and at_start["_merge_kernel"] and at_start["_gemv_kernel"], at_start
    serve_after_start(llm, vocab)
    assert compiled() == at_start


@pytest.mark.gpu
def test_a_new_number_of_sampled_rows_does_not_wait_for_the_gpu(tiny_model):
    """After start-up the LM head runs at any number of rows up to ``max_num_seqs`` without the host waiting
    for the GPU (a cuBLAS matmul's first call at a new row count can wait; the warm-up made those calls).
    Each call comes while the GPU is busy for about 20 ms; the host must be back long before that. A model
    with Qwen3-0.6B's hidden size and a vocabulary of 32K, so that cuBLAS picks among its kernels as it does
    for a real LM head."""
    import time

    from nanovllm import LLM

    path = tiny_model("Qwen3ForCausalLM", hidden_size=1024, vocab_size=32768, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=128)
    llm = LLM(path, device="cuda", dtype="bfloat16", enforce_eager=True, max_num_seqs=64, max_model_len=256,
              kv_cache_memory=1 << 26)
    rows = torch.zeros(64, 1024, dtype=torch.bfloat16, device="cuda")
    waited = []
    for n in range(1, 65):
        torch.cuda.synchronize()
        torch.cuda._sleep(40_000_000)  # about 20 ms on a GPU at 2 GHz
        start = time.perf_counter()
        llm.runner.model.compute_logits(rows[:n])
        if time.perf_counter() - start > 0.005:
            waited.append(n)
    torch.cuda.synchronize()
    assert not waited, f"the host waited for the GPU at {waited} rows"
