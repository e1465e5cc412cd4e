"""Helpers for tests of the engine and of plugins: tiny random Hugging Face models on disk, and random paged
inputs of attention kernels with the checks their tests share.

``tiny_model_dir(path, "Qwen3ForCausalLM")`` writes config.json, model.safetensors (random weights
from transformers' own initialisation, seeded) and a word-level tokenizer whose vocabulary is
``tok0 ... tokN``, so text and token-id prompts both work without any download. Besides Llama and Qwen3,
two models with sliding-window layers for hybrid KV: ``Gemma3ForCausalLM`` (four of six layers slide over
a window of ``HYBRID_WINDOW`` tokens, two attend globally) and ``MistralForCausalLM`` (the window on every
layer); run them at ``block_size=HYBRID_BLOCK_SIZE``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "Qwen3ForCausalLM": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
}

# Hybrid KV: a window of HYBRID_WINDOW tokens, two blocks of HYBRID_BLOCK_SIZE, so prompts of a few hundred
# tokens cross it many times and a window group holds a handful of blocks per sequence.
HYBRID_WINDOW = 32
HYBRID_BLOCK_SIZE = 16
_HYBRID_BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, sliding_window=HYBRID_WINDOW,
    initializer_range=0.3,  # transformers' default 0.02 makes a tiny model repeat one token
)
TINY_CONFIGS |= {
    # Gemma 3 in small: most layers slide over the window, two attend globally (the 270M has 15 and 3)
    "Gemma3ForCausalLM": dict(
        _HYBRID_BASE, num_hidden_layers=6, query_pre_attn_scalar=32, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    ),
    # Mistral: the window on every layer, nothing attends globally
    "MistralForCausalLM": dict(_HYBRID_BASE, num_hidden_layers=3, tie_word_embeddings=False),
}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text",
               "MistralForCausalLM": "mistral"}


def _tokenizer(vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"tok{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="tok0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    def special(word: str) -> AddedToken:  # whole words only, or "tok13" would split into "tok1" + "3"
        return AddedToken(word, single_word=True, special=True)

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=special("tok0"), bos_token=special("tok1"), eos_token=special("tok2"),
        pad_token=special("tok0"),
    )


def tiny_model_dir(path: str | Path, architecture: str = "LlamaForCausalLM", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random model of ``architecture`` to ``path`` and return the path."""
    import torch
    import transformers

    path = Path(path)
    settings = {**TINY_CONFIGS[architecture], **overrides}
    config = transformers.AutoConfig.for_model(MODEL_TYPES[architecture], **settings)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).float().eval()
    gemma = architecture.startswith("Gemma")
    with torch.no_grad():  # transformers initialises norms to ones; perturb them so parity checks see them
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            if gemma and ".post_" in name:  # Gemma's post-norms scale each block's output: without this the
                param.add_(10.0)  # scaled tied embedding outweighs them and greedy decoding repeats a token
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(config.vocab_size).save_pretrained(path)
    return path


def tiny_kv_bytes(architecture: str, num_tokens: int, max_chunk: int, hybrid: bool = True,
                  block_size: int = HYBRID_BLOCK_SIZE) -> int:
    """Float32 KV bytes one sequence of ``num_tokens`` tokens of the tiny ``architecture`` holds at most when
    computed in chunks of up to ``max_chunk`` tokens: every block of every layer in the uniform layout; with
    ``hybrid``, each KV cache group's most blocks (a window group: its window and the chunk), in pool blocks
    of the largest group's size. For sizing ``kv_cache_memory`` to a number of sequences."""
    from types import SimpleNamespace

    from nanovllm.layers.decoder import sliding_window_of

    config = TINY_CONFIGS[architecture]
    layers = config["num_hidden_layers"]
    layer_token_bytes = 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    if not hybrid:
        return -(-num_tokens // block_size) * block_size * layers * layer_token_bytes
    from nanovllm.kv.groups import blocks_per_sequence, kv_cache_groups, num_slots

    groups = kv_cache_groups([sliding_window_of(SimpleNamespace(**config), i) for i in range(layers)])
    blocks = blocks_per_sequence(groups, num_tokens, block_size, max_chunk)
    return blocks * block_size * num_slots(groups) * layer_token_bytes


def hub_cache_entry(cache_dir: str | Path, repo_id: str, model_dir: str | Path, revision: str = "main",
                    commit: str | None = None) -> Path:
    """Put a copy of ``model_dir`` into a Hugging Face hub cache folder (``HF_HUB_CACHE`` layout) as
    ``repo_id`` at ``revision``, the way ``huggingface_hub`` leaves a download; returns the snapshot folder.
    ``commit`` is the snapshot's hash (default: derived from the repo and revision)."""
    import hashlib
    import shutil

    commit = commit or hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot, dirs_exist_ok=True)
    if revision != commit:  # a branch or tag: refs/<revision> names the commit
        (repo / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
    return snapshot


def wait_until(condition, timeout: float, poll: float = 0.05) -> bool:
    """Poll ``condition()`` until it is true (``True``) or ``timeout`` seconds pass (``False``): for what
    another process or thread finishes on its own time (a child exiting, a server draining)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


_ALLOCATIONS = {"empty.memory_format", "empty_strided", "new_empty", "empty_like"}


@contextmanager
def counting_torch_ops() -> Iterator[list[str]]:
    """The names of the torch ops that reach a device inside the block (``aten::`` and a ``.default``
    overload dropped), in order; views and bare allocations are left out. Each new tensor is filled (floats
    with 0, integers with -1), so that what kernels counted but not run leave unwritten holds a definite
    value: for tests that count a policy's launches and ops without running its kernels."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names: list[str] = []

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name().removeprefix("aten::").removesuffix(".default")
            if not func.is_view and name not in _ALLOCATIONS:
                names.append(name)
            out = func(*args, **(kwargs or {}))
            if name in _ALLOCATIONS:
                out.fill_(0 if out.is_floating_point() else -1)
            return out

    with Counting():
        yield names

class LocalServer(NamedTuple):
    """A server run by :func:`local_server`: its base URL (``http://127.0.0.1:PORT``), the uvicorn server
    object and the thread it runs in."""
    url: str
    server: Any
    thread: threading.Thread


@contextmanager
def local_server(app, server_class=None, timeout: float = 60.0, **server_options: Any) -> Iterator[LocalServer]:
    """Serve the ASGI ``app`` with uvicorn (``server_class(config, **server_options)``, default
    ``uvicorn.Server``) in a daemon thread on a free local port. Yields once the server accepts connections
    (``AssertionError`` if it has not after ``timeout`` seconds); on exit asks it to stop and waits for the
    thread. Closing the engine behind ``app`` stays the caller's job."""
    import socket

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = (server_class or uvicorn.Server)(uvicorn.Config(app, log_level="warning"), **server_options)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started or not thread.is_alive(), timeout) and server.started, \
            "the server did not start"
        yield LocalServer(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def settled_rss() -> int:
    """This process's resident set size in bytes, read after a full garbage collection and glibc's
    ``malloc_trim(0)`` (where the C library has it), so freed heap handed back to the system does not count:
    what remains is memory something still holds. Linux only (``/proc/self/statm``)."""
    import ctypes
    import gc
    import os

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc
        pass
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(
    llm, num_requests: int, prompt_len: int, every: int, params, seed: int = 0
) -> Iterator[dict[str, int | float]]:
    """Run ``num_requests`` prompts of random token ids through ``llm.generate``, ``every`` at a time, and
    yield a reading of memory before the first and after each batch: ``requests`` done, ``seconds`` since
    the start, ``rss`` (:func:`settled_rss`) and, where CUDA is initialised, the caching allocator's
    ``cuda_allocated`` and ``cuda_reserved``, all in bytes. Prompts are ``prompt_len`` tokens minus 0-31, so
    lengths vary as real ones do; ids are drawn from ``3 ... llm.vocab_size - 1`` (above the tiny models'
    special tokens)."""
    import time

    import numpy as np
    import torch

    def reading(done: int) -> dict[str, int | float]:
        values: dict[str, int | float] = {"requests": done, "seconds": round(time.perf_counter() - start, 3),
                                          "rss": settled_rss()}
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            values["cuda_allocated"] = torch.cuda.memory_allocated()
            values["cuda_reserved"] = torch.cuda.memory_reserved()
        return values

    rng = np.random.default_rng(seed)
    vocab_size = llm.vocab_size
    start = time.perf_counter()
    done = 0
    yield reading(done)
    while done < num_requests:
        batch = min(every, num_requests - done)
        prompts = [rng.integers(3, vocab_size, prompt_len - int(rng.integers(32))).tolist() for _ in range(batch)]
        llm.generate(prompts, params, use_tqdm=False)
        done += batch
        yield reading(done)


def run_under_interpreter(test_file: str | Path, keyword: str = "interp", timeout: int = 900):
    """Run the ``keyword`` cases of ``test_file`` in a fresh pytest process with Triton's interpreter
    switched on (it must be set before anything imports triton), or wait for the run that
    :func:`start_interpreter_runs` started. Returns ``(returncode, output tail, number of tests passed)``."""
    started = _AHEAD.take(test_file, keyword)
    if started is not None:
        return started.result()
    return _interpreter_process(Path(test_file).resolve(), keyword, timeout)


class InterpreterRuns:
    """Interpreter runs started ahead of their tests, in one background thread, one process at a time, so
    that the interpreter, which keeps one core busy, overlaps the tests that run meanwhile."""

    def __init__(self) -> None:
        self.pool: Any = None  # a ThreadPoolExecutor of one thread, once started
        self.futures: dict[tuple[Path, str], Any] = {}  # (test file, keyword) -> Future of its run
        self.processes: list[Any] = []  # the pytest process under way (subprocess.Popen)

    def start(self, test_files: Iterable[str | Path], keyword: str = "interp", timeout: int = 900) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="interpreter")
        for test_file in test_files:
            key = (Path(test_file).resolve(), keyword)
            if key not in self.futures:
                self.futures[key] = self.pool.submit(_interpreter_process, *key, timeout, self.processes)

    def take(self, test_file: str | Path, keyword: str = "interp") -> Any:
        """The Future of ``test_file``'s run, which :meth:`start` started; None where it did not (or the run
        was cancelled)."""
        started = self.futures.pop((Path(test_file).resolve(), keyword), None)
        return None if started is None or started.cancelled() else started

    def stop(self) -> None:
        """Cancel the runs not begun and kill the one under way."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
        for proc in list(self.processes):
            proc.kill()
        self.futures.clear()


_AHEAD = InterpreterRuns()  # the test session's (the root conftest starts and stops them)


def start_interpreter_runs(test_files: Iterable[str | Path], keyword: str = "interp") -> None:
    """Start the session's :func:`run_under_interpreter` runs of ``test_files`` ahead (:class:`InterpreterRuns`);
    :func:`stop_interpreter_runs` ends what is still running."""
    _AHEAD.start(test_files, keyword)


def stop_interpreter_runs() -> None:
    _AHEAD.stop()


def is_interpreter_run(process: Any) -> bool:
    """Whether ``process`` (a ``psutil.Process``) is one of :func:`run_under_interpreter`'s pytest processes,
    which tests that count their process's children leave out; a process already gone counts as one."""
    import psutil

    try:
        return process.environ().get("TRITON_INTERPRET") == "1"
    except psutil.NoSuchProcess:
        return True


def _interpreter_process(test_file: Path, keyword: str, timeout: int, processes: list[Any] | None = None
                         ) -> tuple[int, str, int]:
    import os
    import re
    import subprocess
    import sys

    # one thread: the interpreter is bound by Python, and the tests beside it need the other core
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore",
         str(test_file), "-k", keyword],
        cwd=test_file.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    processes = [] if processes is None else processes  # where stop() finds it
    processes.append(proc)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output = proc.communicate()[0] + f"\n(killed after {timeout} s)"
    finally:
        processes.remove(proc)
    tail = output[-6000:]
    passed = re.search(r"(\d+) passed", tail)
    return proc.returncode, tail, int(passed.group(1)) if passed else 0


_HOPPER_PREAMBLE = r'''
import functools
import torch, triton
from triton.backends.compiler import GPUTarget


class HopperWithoutGpu:  # what Triton asks its driver while it compiles: an sm_90 target
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0


triton.runtime.driver.set_active(HopperWithoutGpu())
from nanovllm.attention import triton_kernels as tk

tk._dot_fp32 = lambda q: q.dtype == torch.float32  # the GPU's bf16 dots, not the interpreter's stand-in
tk._tma_capable = lambda index: True
tk.is_interpreted = lambda: True  # descriptors over CPU tensors
for kernel in KERNELS:  # compile, never launch
    kernel.run = functools.partial(lambda run, *a, **kw: run(*a, **{**kw, "warmup": True}), kernel.run)
'''


def compile_for_hopper(script: str, kernels: tuple[str, ...], workdir: str | Path, timeout: int = 600) -> str:
    """Run ``script`` in a fresh process where Triton compiles for sm_90 with its bundled ptxas and no GPU:
    ``tk`` is :mod:`nanovllm.attention.triton_kernels`, whose launch wrappers then build descriptors over CPU
    tensors, and the kernels named in ``kernels`` (attributes of ``tk``) compile without launching. Returns
    the script's standard output; skips the calling test where Triton has no bundled ptxas."""
    import os
    import subprocess
    import sys

    import pytest
    import triton

    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    names = ", ".join(f"tk.{name}" for name in kernels)
    path = Path(workdir) / "compile_for_hopper.py"
    path.write_text(_HOPPER_PREAMBLE.replace("KERNELS", f"({names},)") + script)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONWARNINGS": "ignore", "TRITON_CACHE_DIR": str(workdir)}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def prefill_context(q, k, v, query_len: int, scale: float, block_size: int = 16, layer_id: int = 3,
                    seed: int = 0, device: str = "cpu"):
    """``(q_chunk, ctx)``: one sequence of ``T`` tokens (``q [T, H, D]``, ``k``/``v`` ``[T, Hkv, D]``) whose
    last ``query_len`` tokens are a prefill chunk, as a policy sees it: a :class:`~nanovllm.policy.PolicyContext`
    over a paged cache that already holds every key, its blocks in a shuffled order, on the torch backend,
    every tensor on ``device``."""
    import torch

    from nanovllm.attention.metadata import PhaseMetadata
    from nanovllm.attention.torch_backend import TorchBackend
    from nanovllm.policy import PolicyContext

    n = k.shape[0]
    width = -(-n // block_size)
    table = torch.randperm(width, generator=torch.Generator().manual_seed(seed)).int()
    pad = width * block_size - n

    def paged(x):
        shape = (width, block_size, *x.shape[1:])
        cache = torch.zeros(shape, dtype=x.dtype, device=x.device)
        cache[table.long().to(x.device)] = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).view(shape)
        return cache

    lens = [torch.tensor(x, dtype=torch.int32, device=device) for x in ([0, query_len], [n])]
    meta = PhaseMetadata(*lens, table[None, :].to(device), query_len, n)
    chunk = slice(n - query_len, n)
    q, k, v = q.to(device), k.to(device), v.to(device)
    ctx = PolicyContext(layer_id, True, q[chunk], meta, paged(k), paged(v), scale, TorchBackend(), None,
                        k[chunk], v[chunk], torch.arange(n - query_len, n, device=device))
    return q[chunk], ctx


class PagedBatch:
    """Random paged KV for a batch of prefill chunks, as kernel tests over the paged cache need it (plugins'
    too): ``lens`` is ``[(query_len, context_len)]`` per sequence. Each sequence's cache blocks
    (``num_blocks[s]``, by default one more than its context needs) are scattered in a shuffled pool with a
    few blocks nobody owns; block tables are padded with -1 and huge garbage; every cache slot that no
    sequence's context owns holds NaN, so a kernel that reads padding or a foreign slot fails its check.
    ``q``, ``k_cache`` and ``v_cache`` are strided views, as the engine passes them."""

    def __init__(self, lens: list[tuple[int, int]], num_kv_heads: int, group: int, head_dim: int,
                 block_size: int, dtype, device, gen, num_blocks: list[int] | None = None) -> None:
        import torch

        self.lens = lens
        self.scale = head_dim**-0.5
        num_heads = num_kv_heads * group
        nblk = num_blocks or [-(-c // block_size) + 1 for _, c in lens]
        total = sum(nblk) + 3  # a few blocks nobody owns
        perm = torch.randperm(total, generator=gen)
        tables = torch.full((len(lens), max(nblk) + 2), 10**8, dtype=torch.int32)
        tables[:, ::2] = -1
        owned = torch.zeros(total, block_size, dtype=torch.bool)
        used = 0
        for s, (_, ctx) in enumerate(lens):
            tables[s, : nblk[s]] = perm[used : used + nblk[s]].int()
            used += nblk[s]
            pos = torch.arange(ctx)
            owned[tables[s, pos // block_size].long(), pos % block_size] = True
        kv = torch.randn(total, 2, block_size, num_kv_heads, head_dim, generator=gen)
        kv.masked_fill_(~owned[:, None, :, None, None], float("nan"))
        kv = kv.to(dtype).to(device)
        self.k_cache, self.v_cache = kv[:, 0], kv[:, 1]
        qkv = torch.randn(sum(q for q, _ in lens), num_heads + 2, head_dim, generator=gen) * 2.0
        self.q = qkv.to(dtype).to(device)[:, :num_heads]
        q_lens = [q for q, _ in lens]
        self.cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).to(device)
        self.ctx = torch.tensor([c for _, c in lens], dtype=torch.int32, device=device)
        self.tables = tables.to(device)
        self.max_query_len = max(q_lens)

    def dense_causal(self):
        """Plain causal softmax attention per sequence and head, float64 on the CPU: ``(out, lse)``."""
        import torch

        q_all = self.q.double().cpu()
        out = torch.zeros_like(q_all)
        lse = torch.zeros(q_all.shape[:2], dtype=torch.float64)
        group = self.q.shape[1] // self.k_cache.shape[2]
        block_size = self.k_cache.shape[1]
        cu = self.cu.tolist()
        for s, (q_len, ctx) in enumerate(self.lens):
            table = self.tables[s].cpu().long()
            phys, slot = table[torch.arange(ctx) // block_size], torch.arange(ctx) % block_size
            keys, vals = self.k_cache.cpu()[phys, slot], self.v_cache.cpu()[phys, slot]
            for h in range(self.q.shape[1]):
                k, v = keys[:, h // group].double(), vals[:, h // group].double()
                for r in range(q_len):
                    p = ctx - q_len + r
                    scores = q_all[cu[s] + r, h] @ k[: p + 1].T * self.scale
                    out[cu[s] + r, h] = torch.softmax(scores, 0) @ v[: p + 1]
                    lse[cu[s] + r, h] = torch.logsumexp(scores, 0)
        return out, lse


def assert_kernel_matches_reference(out, lse, ref_out, ref_lse, what: str) -> None:
    """A sparse attention kernel's ``(out, lse)`` against its torch reference's on the same inputs, at the
    tolerance of the dtype: no unwritten or NaN output, rows that read nothing (lse -inf; the case must have
    some, and rows that read keys) identical and 0. ``what`` (the seed) starts every failure message."""
    import torch

    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}[ref_out.dtype]
    lse_tol = {torch.bfloat16: 2e-3, torch.float16: 2e-3, torch.float32: 1e-4}[ref_out.dtype]
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype and lse.dtype == torch.float32, what
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), f"{what}: NaN or unwritten output"
    err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
    assert err < tol, f"{what}: relative error {err:.2e}"
    empty = torch.isneginf(ref_lse)
    assert empty.any() and (~empty).any(), f"{what}: the case must have rows with and without keys"
    assert torch.equal(torch.isneginf(lse), empty), f"{what}: rows that read nothing differ"
    assert torch.all(out[empty] == 0), f"{what}: a row that reads nothing must get 0"
    lse_err = (lse[~empty] - ref_lse[~empty]).abs().max().item()
    assert lse_err < lse_tol, f"{what}: lse error {lse_err:.2e}"


def paged_query_keys(lens: list[tuple[int, int]], num_kv_heads: int, group: int, head_dim: int,
                     block_size: int, dtype, device, gen, q_scale: float = 1.0) -> dict[str, Any]:
    """Random q rows of a batch of prefill chunks (``lens``: ``[(query_len, context_len)]``, ``q_scale`` times
    a standard normal) and a paged key cache whose blocks are shuffled in a pool with spare blocks; block
    tables padded with -1. q and k_cache are strided views, as the engine passes them. The arguments of a
    pattern estimate's kernel, by name: ``q``, ``k_cache``, ``block_tables``, ``cu_seqlens_q``,
    ``context_lens``, ``scale``."""
    import torch

    num_seqs = len(lens)
    blocks = [-(-ctx // block_size) for _, ctx in lens]
    pool = sum(blocks) + 3
    perm = torch.randperm(pool, generator=gen)
    tables = torch.full((num_seqs, max(blocks) + 2), -1, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = perm[used: used + nb].int()
        used += nb
    heads = num_kv_heads * group
    num_tokens = sum(q for q, _ in lens)
    qkv = torch.randn(num_tokens, heads + 2 * num_kv_heads, head_dim, generator=gen) * q_scale
    kv = torch.randn(pool, block_size, 2, num_kv_heads, head_dim, generator=gen)
    cu = torch.tensor([0] + [q for q, _ in lens], dtype=torch.int32).cumsum(0).int()
    return dict(
        q=qkv.to(dtype).to(device)[:, :heads],
        k_cache=kv.to(dtype).to(device)[:, :, 0],
        block_tables=tables.to(device),
        cu_seqlens_q=cu.to(device),
        context_lens=torch.tensor([c for _, c in lens], dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def assert_interpreter_cases_pass(test_file: str | Path, expected: int, keyword: str = "interp") -> None:
    """The body of a test that runs ``test_file``'s ``keyword`` cases under Triton's interpreter on the CPU,
    in a fresh process (:func:`run_under_interpreter`): skipped on a machine with CUDA (its GPU runs the
    ``gpu`` cases) and inside that process itself; fails unless exactly ``expected`` cases pass."""
    import os

    import pytest
    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("runs the interpreter cases in a subprocess on machines without CUDA")
    pytest.importorskip("triton")
    returncode, tail, passed = run_under_interpreter(test_file, keyword)
    assert returncode == 0, tail
    assert passed == expected, tail


def prompt_logprobs(llm, prompt: list[int]) -> list[float]:
    """The logprob of each prompt token after the first, given the tokens before it."""
    from nanovllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return [next(iter(row.values())).logprob for row in out.prompt_logprobs[1:]]


def assert_model_family_registered(dist: str, architecture: str, model_class: type) -> None:
    """A model-family plugin's registration, as its tests check it: its distribution's entry point in group
    ``nanovllm`` names its ``plugin`` module; discovery loads it without error and it registers exactly
    ``model:ARCHITECTURE``, whose target loads as ``model_class``."""
    from importlib import metadata

    from nanovllm.plugins import discover, load_target

    module = dist.replace("-", "_") + ".plugin"
    eps = [ep for ep in metadata.entry_points(group="nanovllm") if ep.value == module]
    assert eps and {ep.dist.name for ep in eps} == {dist}
    plugins = discover()
    info = next(p for p in plugins.plugins if p.dist == dist)
    assert info.error is None and info.registered == [f"model:{architecture}"]
    family = plugins.registry.model_families[architecture]
    assert family.dist == dist
    assert load_target(family.target) is model_class


def assert_registration_imports_no_torch(architecture: str) -> None:
    """A fresh process registers ``architecture`` (a plugin's model family) without importing torch: the
    registration stays lazy."""
    import subprocess
    import sys

    code = (
        "import sys; from nanovllm.plugins import discover; "
        f"assert {architecture!r} in discover().registry.model_families; "
        "assert 'torch' not in sys.modules, 'registration imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
