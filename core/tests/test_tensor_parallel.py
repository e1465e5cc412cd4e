"""Tensor parallelism on the CPU: two ranks over gloo, rank 0 in the test's process, one spawned worker.

We check that two ranks generate the greedy tokens of one rank (and the same logprobs, to float32
rounding) for Llama and Qwen3, and on random weights, in steps that mix prefill chunks with decodes and ask
for prompt logprobs; that each rank's KV cache holds its own KV heads and its policies hear of the same
block allocations as rank 0; that only rank 0 gets the logits of the whole vocabulary; that the engine
leaves no child process behind when closed or garbage-collected; that a killed worker (between steps or
inside one), a worker that fails while building its runner, and the death of the engine's process are
each noticed (a clear error in the engine; workers that exit by themselves); that a worker that hangs in
its CUDA graph capture (simulated) leaves an engine that decodes eagerly and says so. The engine's ranks
take their steps from a shared-memory channel whose name is gone from /dev/shm once the workers have
started, whatever happens next; ranks started by torchrun (one node, or two nodes on this host) keep the
gloo control group.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nanovllm.distributed
import psutil
import pytest
from nanovllm import LLM, SamplingParams
from nanovllm.distributed import tp_rank
from nanovllm.shm_broadcast import ShmBroadcast
from nanovllm.testing import is_interpreter_run, wait_until

PROMPTS = [[5, 6, 7], list(range(10, 40)), list(range(50, 61)), list(range(100, 170))]
ENGINE = dict(device="cpu", kv_cache_memory=1 << 24, block_size=8, max_num_batched_tokens=48)
INIT = 0.3  # transformers' default 0.02 makes a tied tiny model repeat its input token forever


class AllocationRecorder:
    """An observer that writes, per rank, its KV heads and the blocks it was told were allocated."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.record: dict = {"allocated": []}

    def initialize(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device) -> None:
        self.record.update(num_kv_heads=num_kv_heads, num_blocks=num_blocks)
        self._write()

    def on_blocks_allocated(self, block_ids) -> None:
        self.record["allocated"].append(block_ids.tolist())
        self._write()

    def _write(self) -> None:
        Path(self.folder, f"rank{tp_rank()}.json").write_text(json.dumps(self.record))


class FailsOnWorkers:
    """An observer that fails to initialise on every rank but 0, as a worker that runs out of memory would."""

    def initialize(self, *args) -> None:
        if tp_rank() != 0:
            raise MemoryError("rank-local failure for the test")


def pretend_to_capture(graphs) -> None:
    """Decode graphs on the CPU for the capture tests: nothing is captured, the engine steps eagerly."""


class HangsInCaptureOnWorkers:
    """An observer that, on every rank but 0, makes the runner capture decode graphs on the CPU and hang
    in that capture (past any time box: the engine kills the worker)."""

    def initialize(self, *args) -> None:
        from nanovllm.engine.cuda_graphs import CudaGraphRunner

        if tp_rank() != 0:
            CudaGraphRunner.usable = lambda graphs: not graphs.config.enforce_eager
            CudaGraphRunner._capture = lambda graphs: time.sleep(600)


class CapturesOnWorkers:
    """An observer that, on every rank but 0, makes the runner capture decode graphs on the CPU at once."""

    def initialize(self, *args) -> None:
        from nanovllm.engine.cuda_graphs import CudaGraphRunner

        if tp_rank() != 0:
            CudaGraphRunner.usable = lambda graphs: not graphs.config.enforce_eager
            CudaGraphRunner._capture = pretend_to_capture


class DiesInAStepOnWorkers:
    """An observer that, on every rank but 0, kills its own process (SIGKILL) when a step tells it of the
    second block allocation: a worker that dies inside a step, after earlier steps ran."""

    def __init__(self) -> None:
        self.allocations = 0

    def on_blocks_allocated(self, block_ids) -> None:
        self.allocations += 1
        if tp_rank() != 0 and self.allocations == 2:
            os.kill(os.getpid(), signal.SIGKILL)


class HoldsALambda:
    """An observer that cannot be pickled to the workers."""

    def __init__(self) -> None:
        self.transform = lambda x: x

    def on_blocks_allocated(self, block_ids) -> None:
        pass


def children() -> list[psutil.Process]:
    """This process's children, but multiprocessing's resource tracker (one per process, started with the
    first spawned process; it holds no model and leaves with this process) and the suite's interpreter runs
    in the background."""
    return [p for p in psutil.Process().children(recursive=True)
            if not is_interpreter_run(p) and not any("resource_tracker" in part for part in p.cmdline())]


# Wraps ShmBroadcast.create so that it prints each channel's name (in a script, a fresh process).
ANNOUNCE_CHANNELS = """
from nanovllm.shm_broadcast import ShmBroadcast
_create = ShmBroadcast.create.__func__
def _announced(cls, *args, **kwargs):
    channel = _create(cls, *args, **kwargs)
    print(channel.name, flush=True)
    return channel
ShmBroadcast.create = classmethod(_announced)
"""


@pytest.fixture
def channels(monkeypatch) -> list[str]:
    """The names of the step channels this test's engines create (other processes may make their own)."""
    names = []
    create = ShmBroadcast.create.__func__

    def recorded(cls, *args, **kwargs):
        channel = create(cls, *args, **kwargs)
        names.append(channel.name)
        return channel

    monkeypatch.setattr(ShmBroadcast, "create", classmethod(recorded))
    return names


def in_shm(names: list[str]) -> list[str]:
    """Those of the channels ``names`` still in /dev/shm (none should outlive an engine's start)."""
    return [name for name in names if Path("/dev/shm", name).exists()]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def params() -> list[SamplingParams]:
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    return [SamplingParams(**greedy), SamplingParams(**greedy, prompt_logprobs=2), SamplingParams(**greedy),
            SamplingParams(**greedy)]


@pytest.mark.parametrize("arch, load_format", [("LlamaForCausalLM", "auto"), ("Qwen3ForCausalLM", "auto"),
                                                ("LlamaForCausalLM", "dummy")])
def test_two_ranks_generate_the_tokens_of_one(arch, load_format, tiny_model, one_thread, tmp_path, channels):
    """Random weights too (``load_format="dummy"``, as the shape presets load): each rank makes only its shard
    of them, and the shards are those of one rank's model."""
    path = tiny_model(arch, initializer_range=INIT)
    engine = {**ENGINE, "load_format": load_format}
    with LLM(path, **engine) as one:
        expected = one.generate(PROMPTS, params(), use_tqdm=False)
    before = children()
    with LLM(path, tensor_parallel_size=2, observers=[AllocationRecorder(str(tmp_path))], **engine) as two:
        assert len(children()) == len(before) + 1  # one worker, rank 1
        assert two.runner.kv.kv_cache.shape[4] == 1  # of the model's 2 KV heads, rank 0 holds one
        assert nanovllm.distributed._control_channel is two.world.workers.channel  # steps go through it
        assert channels == [two.world.workers.channel.name] and not in_shm(channels)  # mapped, and unlinked
        got = two.generate(PROMPTS, params(), use_tqdm=False)
    assert children() == before
    assert nanovllm.distributed._control_channel is None
    for want, out in zip(expected, got, strict=True):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(set(want.outputs[0].token_ids)) > 1  # a model that repeats one token would prove little
        for lp_want, lp_got in zip(want.outputs[0].logprobs, out.outputs[0].logprobs, strict=True):
            assert lp_got.keys() == lp_want.keys()
            for token, entry in lp_want.items():
                assert lp_got[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
    for want, out in zip(expected[1].prompt_logprobs[1:], got[1].prompt_logprobs[1:], strict=True):
        assert out.keys() == want.keys()
        for token, entry in want.items():
            assert out[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["num_kv_heads"] == ranks[1]["num_kv_heads"] == 1
    assert ranks[0]["num_blocks"] == ranks[1]["num_blocks"]
    assert ranks[0]["allocated"] and ranks[1]["allocated"] == ranks[0]["allocated"]


def test_where_stores_may_be_reordered_steps_go_on_the_gloo_group(tiny_model, one_thread, monkeypatch):
    import platform

    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(path, **ENGINE) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, greedy, use_tqdm=False)]
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with LLM(path, tensor_parallel_size=2, **ENGINE) as two:
        assert two.world.workers.channel is None and nanovllm.distributed._control_channel is None
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, greedy, use_tqdm=False)] == expected


def test_two_ranks_with_kv_offload_generate_the_tokens_of_one(tiny_model, one_thread):
    """Each rank keeps its KV heads in its own host pool and loads them in several pieces per layer."""
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    head_block = 2 * 8 * 16 * 4  # K and V of one KV head of one block: 8 tokens, head size 16, float32
    options = {**ENGINE, "kv_cache_memory": None, "max_num_seqs": 4, "kv_offloading_size": 0.01,
               "kv_offloading_buffer_size": 2 * 24 * head_block / 2**30}  # 2 slots of 24 head blocks
    prompts = [[(7 * i + 3 * j) % 240 + 3 for j in range(n)] for i, n in enumerate([90, 33, 140])]  # 35 blocks
    with LLM(path, **options) as one:
        expected = one.generate(prompts, params()[:3], use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, **options) as two:
        offload = two.runner.kv.engine
        loads = []
        load = offload._load
        offload._load = lambda layer_id, *args: loads.append(layer_id) or load(layer_id, *args)
        got = two.generate(prompts, params()[:3], use_tqdm=False)
    # rank 0's pool slots hold 24 of its 35 head blocks: two pieces per layer in each of the 11 decode steps
    assert offload.capacity == 24 and len(loads) >= 2 * 11 * len(two.runner.attention_layers)
    for want, out in zip(expected, got, strict=True):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert out.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-4)


def test_a_killed_worker_is_reported_and_the_engine_stops(tiny_model, one_thread, channels):
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    before = children()
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    (worker,) = [p for p in children() if p not in before]
    worker.send_signal(signal.SIGKILL)
    assert wait_until(lambda: gone(worker.pid), 10)  # not reaped here: the engine reads its exit status
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) was killed by signal SIGKILL"):
        llm.generate(PROMPTS, params(), use_tqdm=False)
    with pytest.raises(RuntimeError, match="create a new engine"):  # every later step says so at once
        llm.generate(PROMPTS, params(), use_tqdm=False)
    del llm
    gc.collect()
    assert children() == before
    assert channels and not in_shm(channels)


def test_a_worker_killed_inside_a_step_is_reported_and_the_engine_stops(tiny_model, one_thread, channels):
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    before = children()
    llm = LLM(path, tensor_parallel_size=2, observers=[DiesInAStepOnWorkers()], **ENGINE)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) was killed by signal SIGKILL"):
        llm.generate(PROMPTS, params(), use_tqdm=False)
    assert time.monotonic() - start < 60  # rank 0's collective failed at once, not at its time-out
    with pytest.raises(RuntimeError, match="create a new engine"):
        llm.generate(PROMPTS, params(), use_tqdm=False)
    llm.close()
    assert children() == before
    assert channels and not in_shm(channels)


def test_a_worker_that_fails_to_build_is_reported(tiny_model, one_thread, channels):
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    before = children()
    start = time.monotonic()
    reported = r"(?s)worker rank 1 \(pid \d+\) (raised an error|exited with code 1).*MemoryError: rank-local"
    with pytest.raises(RuntimeError, match=reported):
        LLM(path, tensor_parallel_size=2, observers=[FailsOnWorkers()], **ENGINE)
    assert time.monotonic() - start < 60  # reported, not waited out
    assert children() == before
    assert channels and not in_shm(channels)
    with LLM(path, **ENGINE) as one:  # the failed world is gone: one rank works in the same process
        assert one.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_an_observer_the_workers_cannot_get_is_refused_before_they_start(tiny_model):
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    before = children()
    with pytest.raises(ValueError, match=r"observer 'HoldsALambda' cannot be pickled \(.*lambda.*register it"):
        LLM(path, tensor_parallel_size=2, observers=[HoldsALambda()], **ENGINE)
    assert children() == before
    script = textwrap.dedent(f"""
        from nanovllm import LLM
        class Interactive:
            def on_blocks_allocated(self, block_ids):
                pass
        try:
            LLM({path!r}, tensor_parallel_size=2, observers=[Interactive()], **{ENGINE!r})
        except ValueError as exc:
            print(exc)
    """)  # run with -c: as in a notebook or a REPL, __main__ has no file a worker could import
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert "cannot import observer class 'Interactive': it is defined in an interactive session" in done.stdout, (
        done.stdout + done.stderr[-2000:])


@pytest.fixture
def rank_0_captures(monkeypatch) -> list[float]:
    """Rank 0 (this process) captures decode graphs on the CPU (nothing, at once); the times it did."""
    from nanovllm.engine.cuda_graphs import CudaGraphRunner

    captures = []
    monkeypatch.setattr(CudaGraphRunner, "usable", lambda graphs: not graphs.config.enforce_eager)
    monkeypatch.setattr(CudaGraphRunner, "_capture", lambda graphs: captures.append(time.time()))
    monkeypatch.setenv("NANOVLLM_CAPTURE_TIMEOUT", "1")
    return captures


def test_a_rank_that_does_not_capture_in_time_makes_the_engine_decode_eagerly(tiny_model, one_thread,
                                                                               rank_0_captures):
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(path, **ENGINE) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, greedy, use_tqdm=False)]
    rank_0_captures.clear()  # one rank's
    before = children()
    start = time.monotonic()
    late = (r"(?s)not every tensor-parallel rank captured its decode CUDA graphs within 1 s.*Ranks 1 failed.*"
            r"started its 2 ranks again without CUDA graphs.*enforce_eager=True.*NANOVLLM_CAPTURE_TIMEOUT")
    with pytest.warns(RuntimeWarning, match=late):
        llm = LLM(path, tensor_parallel_size=2, observers=[HangsInCaptureOnWorkers()], **ENGINE)
    with llm:
        assert time.monotonic() - start < 60  # the hung worker was given up on, not waited out
        assert len(rank_0_captures) == 1  # the first world captured; the second one did not try
        assert llm.config.enforce_eager and llm.runner.config.enforce_eager
        assert len(children()) == len(before) + 1  # the new world's worker; the hung one is gone
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == expected
    assert children() == before


def test_a_rank_0_capture_past_the_time_warns_but_keeps_the_graphs(tiny_model, one_thread, rank_0_captures,
                                                                  monkeypatch):
    """Rank 0 cannot interrupt its own capture: past the time it warns, and once every rank has captured
    the engine keeps its graphs."""
    from nanovllm.engine.cuda_graphs import CudaGraphRunner

    monkeypatch.setattr(CudaGraphRunner, "_capture", lambda graphs: time.sleep(2))
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    late = "rank 0 has not captured its decode CUDA graphs in 1 s"
    with pytest.warns(RuntimeWarning, match=late) as caught:
        llm = LLM(path, tensor_parallel_size=2, observers=[CapturesOnWorkers()], **ENGINE)
    with llm:
        assert not llm.config.enforce_eager
        assert not [w for w in caught if "again without CUDA graphs" in str(w.message)]
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_ranks_capture_decode_graphs_together_or_not_at_all(tiny_model, one_thread):
    """The workers could capture (made to think so here), rank 0 cannot (the CPU): they all decode eagerly,
    with one rank's tokens. A worker that captured alone would wait forever in its warm-up collectives, so
    the engine runs in a process of its own with a time limit."""
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(path, **ENGINE) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, SamplingParams(**greedy),
                                                                   use_tqdm=False)]
    script = textwrap.dedent(f"""
        from nanovllm import LLM, SamplingParams
        from test_tensor_parallel import CapturesOnWorkers
        if __name__ == "__main__":
            with LLM({path!r}, tensor_parallel_size=2, observers=[CapturesOnWorkers()], **{ENGINE!r}) as llm:
                outputs = llm.generate({PROMPTS!r}, SamplingParams(**{greedy!r}), use_tqdm=False)
                print(len(llm.runner.cuda_graphs.graphs), [o.outputs[0].token_ids for o in outputs])
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(maxsplit=1) == ["0", f"{expected}\n"]


def test_async_engine_shutdown_stops_the_workers(tiny_model, one_thread):
    import asyncio

    from nanovllm import AsyncLLM

    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    with LLM(path, **ENGINE) as one:
        want = one.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    before = children()
    engine = AsyncLLM(path, tensor_parallel_size=2, **ENGINE)

    async def last_output():
        outputs = [out async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=3), request_id="r")]
        return outputs[-1]

    assert asyncio.run(last_output()).outputs[0].token_ids == want
    assert len(children()) == len(before) + 2  # the engine's own process (AsyncLLM's default) and its worker
    engine.shutdown()
    assert wait_until(lambda: children() == before, 30)


def test_garbage_collection_stops_the_workers(tiny_model, one_thread):
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    before = children()
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    worker = next(p for p in children() if p not in before)
    del llm
    gc.collect()
    assert gone(worker.pid)
    assert children() == before


@pytest.mark.slow
def test_workers_exit_when_the_engine_process_dies(tiny_model, tmp_path):
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    script = textwrap.dedent(f"""
        import os, sys
        import psutil
        from nanovllm import LLM
        if __name__ == "__main__":
            llm = LLM({path!r}, tensor_parallel_size=2, **{ENGINE!r})
            llm.generate([[5, 6, 7]], use_tqdm=False)
            print(llm.world.workers.channel.name, *[p.pid for p in psutil.Process().children(recursive=True)],
                  flush=True)
            os.kill(os.getpid(), 9)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    channel, *pids = done.stdout.split()
    assert pids
    assert wait_until(lambda: all(gone(int(p)) for p in pids), 15)
    assert not in_shm([channel])


@pytest.mark.slow
def test_an_engine_killed_while_its_workers_start_leaves_no_shared_memory(tiny_model):
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    script = ANNOUNCE_CHANNELS + textwrap.dedent(f"""
        from nanovllm import LLM
        if __name__ == "__main__":
            LLM({path!r}, tensor_parallel_size=2, **{ENGINE!r})
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    engine = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        channel = engine.stdout.readline().strip()
        time.sleep(0.2)  # the workers are still importing torch: they have not attached
        assert channel and in_shm([channel]) and engine.poll() is None
    finally:
        engine.kill()
    engine.wait()
    # the workers see their parent gone and exit; then multiprocessing's resource tracker unlinks the segment
    assert wait_until(lambda: not in_shm([channel]), 60), engine.stderr.read()[-2000:]


# -- the LM head --------------------------------------------------------------------------------------

def lm_head_logits(rank: int, store, hidden, weight):
    """Rank ``rank`` of a two-rank gloo world: what its vocabulary-parallel LM head returns for ``hidden``."""
    from nanovllm.distributed import destroy_tensor_parallel, init_tensor_parallel
    from nanovllm.layers.embed_head import ParallelLMHead

    init_tensor_parallel(rank, 2, "cpu", store)
    try:
        head = ParallelLMHead(*weight.shape)
        head.weight_loader(head.weight, weight)
        return head(hidden)
    finally:
        destroy_tensor_parallel()


def lm_head_on_rank_1(port: int, hidden, weight, out: str) -> None:
    import torch.distributed as dist

    logits = lm_head_logits(1, dist.TCPStore("127.0.0.1", port, 2, is_master=False), hidden, weight)
    Path(out).write_text(json.dumps(None if logits is None else list(logits.shape)))


def test_only_rank_0_gets_the_logits_of_the_whole_vocabulary(one_thread, tmp_path):
    """Only rank 0 samples: the other ranks send their slice of the logits and never hold the whole
    vocabulary's (a vocabulary of 11 over two ranks: the last rank pads its slice)."""
    import multiprocessing

    import torch
    import torch.distributed as dist

    hidden, weight = torch.randn(3, 8), torch.randn(11, 8)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    out = tmp_path / "rank1.json"
    rank1 = multiprocessing.get_context("spawn").Process(target=lm_head_on_rank_1,
                                                         args=(store.port, hidden, weight, str(out)))
    rank1.start()
    try:
        logits = lm_head_logits(0, store, hidden, weight)
    finally:
        rank1.join(60)
    assert rank1.exitcode == 0
    torch.testing.assert_close(logits, hidden @ weight.T)
    assert json.loads(out.read_text()) is None


# -- sharded loading ---------------------------------------------------------------------------------

def test_each_rank_reads_only_its_shard_of_each_weight(tiny_model, tmp_path):
    """Two gloo ranks (torchrun) load Llama with biases on every projection and a vocabulary that does not
    split evenly (the last rank pads), and Qwen3 with tied embeddings: every parameter is the checkpoint's
    narrowed by hand, and each rank read from the file exactly the elements it holds, one read per tensor.
    With random weights, each rank makes exactly the elements it holds, never a whole sharded tensor, and
    they are the random checkpoint's (made whole in the check) narrowed the same way."""
    models = {
        "LlamaForCausalLM": tiny_model("LlamaForCausalLM", vocab_size=251, attention_bias=True, mlp_bias=True),
        "Qwen3ForCausalLM": tiny_model("Qwen3ForCausalLM"),
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).with_name("tp_shard_check.py")), str(tmp_path),
         *[f"{arch}={path}" for arch, path in models.items()]],
        capture_output=True, text=True, env=env, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results.keys() == {f"{arch}{kind}" for arch in models for kind in ("", " random")}
        for arch, result in results.items():
            assert result["differ"] == [], (rank, arch)
            assert result["read"] == result["held"], (rank, arch)  # not a whole tensor then narrowed
            assert result["read"] < 0.7 * result["checkpoint"], (rank, arch)  # the model is mostly sharded
            assert result["reads_per_tensor"] == [1], (rank, arch)


def test_random_weights_are_one_model_made_a_slice_at_a_time(monkeypatch):
    """A random checkpoint tensor made in parts (and in chunks of rows) equals the same tensor made whole:
    each element depends on the tensor's name and its position only. Weights are small and centred, norms
    one; another name gives other values."""
    import torch
    from nanovllm.engine.model_loading import RandomTensor

    def made(name, shape, index=...):
        return RandomTensor(name, torch.Size(shape), torch.float32, torch.device("cpu"))[index]

    whole = made("model.layers.0.mlp.down_proj.weight", (64, 96))
    assert torch.equal(made("model.layers.0.mlp.down_proj.weight", (64, 96), (slice(None), slice(48, 96))),
                       whole[:, 48:])
    monkeypatch.setattr(RandomTensor, "CHUNK", 100)  # one row of 96 a chunk
    assert torch.equal(made("model.layers.0.mlp.down_proj.weight", (64, 96), (slice(8, 40),)), whole[8:40])
    assert whole.abs().max() <= 1e-3 and abs(whole.mean()) < 1e-4 and whole.std() > 5e-4
    assert whole.unique().numel() > 0.99 * whole.numel()
    other = made("model.layers.1.mlp.down_proj.weight", (64, 96))
    assert (other == whole).float().mean() < 0.01
    assert torch.equal(made("model.norm.weight", (96,), (slice(10, 20),)), torch.ones(10))
    with pytest.raises(TypeError, match="contiguous slices"):
        made("model.norm.weight", (96,), (slice(0, 10, 2),))


def test_the_70b_preset_has_llama_3_1_70b_s_shape():
    """Counted on the meta device: nothing is allocated. Four ranks share its heads, KV heads and MLP."""
    from nanovllm.bench.offload import model_shape, weight_bytes

    shape = model_shape("llama-3.1-70b", {"device": "cpu", "dtype": "bfloat16"})
    hf = shape.hf_config
    assert (hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size) == (80, 8192, 28672)
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.vocab_size) == (64, 8, 128, 128256)
    assert hf.rope_scaling["rope_type"] == "llama3" and hf.max_position_embeddings == 131072
    assert 70.5e9 < weight_bytes(shape) / 2 < 70.6e9  # parameters, bfloat16
    assert shape.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_a_checkpoint_that_does_not_match_its_config_is_named(tiny_model, tmp_path):
    """The vocabulary (sharded by rows even on one rank) is checked against config.json before it is read."""
    import shutil

    from nanovllm.engine.loader import load_weights
    from nanovllm_llama.model import LlamaForCausalLM
    from transformers import AutoConfig

    path = tmp_path / "model"
    shutil.copytree(tiny_model("LlamaForCausalLM", initializer_range=INIT), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": 250}))
    model = LlamaForCausalLM(AutoConfig.from_pretrained(path))
    with pytest.raises(ValueError, match=r"shape \(256, 64\) has size 256 along dim 0 where the model expects 250"):
        load_weights(model, path)


# -- ranks started by torchrun (distributed_executor_backend="external_launcher") ---------------------

TORCHRUN_SCRIPT = """
import json, os, sys
import torch
import nanovllm.distributed
from nanovllm import LLM, SamplingParams
torch.set_num_threads(1)
path, engine, prompts, bad_prompt, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
with LLM(path, tensor_parallel_size=2, distributed_executor_backend="external_launcher", **engine) as llm:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    try:  # rank 0 refuses the prompt; every rank must raise, then run the next call together
        llm.generate([[int(bad_prompt)]], greedy, use_tqdm=False)
        error = None
    except (ValueError, RuntimeError) as exc:
        error = str(exc)
    again = llm.generate(prompts[:1], greedy, use_tqdm=False)
    gloo = nanovllm.distributed._control_channel is None  # perhaps on several hosts: no shared memory
result = {"tokens": [o.outputs[0].token_ids for o in outputs], "error": error, "again": again[0].outputs[0].token_ids,
          "gloo": gloo}
with open(os.path.join(out, "rank" + os.environ["RANK"] + ".json"), "w") as f:  # the ranks share stdout
    json.dump(result, f)
"""


def test_torchrun_ranks_return_the_tokens_of_one_rank_on_every_rank(tiny_model, one_thread, tmp_path):
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    with LLM(path, **ENGINE) as one:
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, greedy, use_tqdm=False)]
    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
         path, json.dumps(ENGINE), json.dumps(PROMPTS), "999999", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert result["tokens"] == expected
        assert result["again"] == expected[0]
        assert result["gloo"]
    assert "outside the vocabulary" in results[0]["error"]
    assert "rank 0 raised" in results[1]["error"] and "outside the vocabulary" in results[1]["error"]


def test_torchrun_nodes_on_one_host_give_the_tokens_of_one_rank(tiny_model, one_thread, tmp_path):
    """Two torchrun nodes of one rank each (scripts/torchrun_nodes.sh: each its own agent, meeting at
    127.0.0.1 as across hosts) run examples/torchrun_generate.py: every rank returns one rank's tokens."""
    root = Path(__file__).resolve().parents[2]
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    with LLM(path, **ENGINE) as one:
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, greedy, use_tqdm=False)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(root / "scripts" / "torchrun_nodes.sh"), "2", "1", str(root / "examples" / "torchrun_generate.py"),
         path, "--prompts", json.dumps(PROMPTS), "--engine", json.dumps(ENGINE), "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected  # rank 0 prints them
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"world_size": 2, "tokens": expected}


def test_symmetric_memory_needs_every_rank_s_gpu_in_reach(monkeypatch):
    """torchrun nodes on one host see one host name, but each only its own GPUs: no symmetric memory then,
    as across hosts. GPUs are told apart by UUID, which CUDA_VISIBLE_DEVICES does not renumber."""
    import torch
    from nanovllm.distributed import peer_problem

    visible = ["GPU-a", "GPU-b"]  # this process's GPUs 0 and 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(nanovllm.distributed, "gpu_uuid", lambda index: visible[index])
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda here, there: True)
    assert peer_problem([("host", "GPU-a"), ("host", "GPU-b")]) is None
    assert "not visible" in peer_problem([("host", "GPU-a"), ("host", "GPU-c")])  # GPU-c: the other node's
    assert "several hosts" in peer_problem([("host", "GPU-a"), ("other", "GPU-b")])
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda here, there: False)
    assert "no peer access" in peer_problem([("host", "GPU-a"), ("host", "GPU-b")])


def test_external_launcher_needs_torchrun_and_a_matching_world(tiny_model, monkeypatch):
    path = tiny_model("LlamaForCausalLM", initializer_range=INIT)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"RANK, WORLD_SIZE.*torchrun --nproc-per-node 2 script\.py"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="external_launcher", **ENGINE)
    env = dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="WORLD_SIZE=4 ranks but tensor_parallel_size=2"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="external_launcher", **ENGINE)
    assert tp_rank() == 0 and not __import__("torch").distributed.is_initialized()


def test_what_holds_the_communicator_is_released_before_the_world_is_left():
    """NCCL waits forever to destroy a communicator that a live CUDA graph captured (pytorch#115388): the
    runner registers its graphs' release, which runs first, once; a holder already gone is skipped."""
    calls = []

    class Holder:
        def release(self) -> None:
            calls.append(nanovllm.distributed._control_group)

    holder, gone = Holder(), Holder()
    nanovllm.distributed._control_group = "still in the world"
    nanovllm.distributed.release_before_destroy(holder.release)
    nanovllm.distributed.release_before_destroy(gone.release)
    del gone
    gc.collect()
    nanovllm.distributed.destroy_tensor_parallel()
    nanovllm.distributed.destroy_tensor_parallel()
    assert calls == ["still in the world"]
    assert nanovllm.distributed._control_group is None


def test_the_capture_time_box_must_be_seconds(monkeypatch):
    from nanovllm.engine.cuda_graphs import DEFAULT_CAPTURE_TIMEOUT, capture_timeout

    monkeypatch.delenv("NANOVLLM_CAPTURE_TIMEOUT", raising=False)
    assert capture_timeout() == DEFAULT_CAPTURE_TIMEOUT
    monkeypatch.setenv("NANOVLLM_CAPTURE_TIMEOUT", "2.5")
    assert capture_timeout() == 2.5
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv("NANOVLLM_CAPTURE_TIMEOUT", bad)
        with pytest.raises(ValueError, match=rf"NANOVLLM_CAPTURE_TIMEOUT='{bad}' must be a number of seconds"):
            capture_timeout()
