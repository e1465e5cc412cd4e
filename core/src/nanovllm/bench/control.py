"""Per-step control overhead of tensor parallelism: rank 0 broadcasting a step's plan to the other ranks.

``python -m nanovllm.bench.control [--seqs 256] [--context 2048] [--steps 2000] [--world-size 2]``

For each transport of :func:`nanovllm.distributed.broadcast_control` (the gloo control group, and the
shared-memory channel the engine uses when it starts the ranks on its own host) this starts a fresh world
of ``world_size`` CPU ranks and broadcasts, ``steps`` times, the plan of a decode step of ``seqs``
sequences of ``context`` tokens each (``block_size``-token blocks, so a block table of ``context /
block_size`` entries per sequence, as ``ModelRunner.prepare`` makes it). After each broadcast all ranks
meet in a small all-reduce on the data group, as a step's forward pass makes them. Reported per step,
median and 90th percentile: rank 0's time in the broadcast (wall clock, and its CPU time, which a busy host
inflates less), and the delivery latency (rank 0 starting the broadcast to a rank holding the plan;
``time.perf_counter`` is one clock for all processes of a host).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.distributed import broadcast_control, destroy_tensor_parallel, init_tensor_parallel
from nanovllm.engine.model_runner import PhaseArrays, StepPlan
from nanovllm.shm_broadcast import ShmBroadcast

TRANSPORTS = ("gloo", "shm")
WARMUP_STEPS = 50


def decode_plan(seqs: int, context: int, block_size: int) -> StepPlan:
    """The plan of a decode step of ``seqs`` sequences of ``context`` tokens (random blocks)."""
    rng = np.random.default_rng(0)
    blocks = -(-context // block_size)
    tables = rng.integers(0, 1 << 20, size=(seqs, blocks)).astype(np.int32)
    positions = np.full(seqs, context - 1, dtype=np.int64)
    return StepPlan(
        input_ids=rng.integers(0, 150_000, size=seqs).astype(np.int64),
        positions=positions,
        slot_mapping=tables[:, -1].astype(np.int64) * block_size + positions % block_size,
        num_decode_tokens=seqs,
        decode=PhaseArrays(np.arange(seqs + 1, dtype=np.int32), np.full(seqs, context, dtype=np.int32),
                           tables, 1, context),
        prefill=None,
        placeholder_rows=None,
        placeholder_sources=None,
        sample_rows=None,
        num_sampling=seqs,
        prompt_logprob_rows=None,
        allocated_blocks=None,
    )


def _step_sync() -> None:
    dist.all_reduce(torch.zeros(1))


def _reader(rank: int, world_size: int, port: int, channel_name: str | None, steps: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    channel = None if channel_name is None else ShmBroadcast.attach(channel_name, world_size - 1, rank - 1)
    init_tensor_parallel(rank, world_size, "cpu", store, channel=channel)
    latencies = []
    for _ in range(steps):
        _, _, sent = broadcast_control()
        latencies.append(time.perf_counter() - sent)
        _step_sync()
    dist.gather_object(latencies[WARMUP_STEPS:], None, dst=0)
    destroy_tensor_parallel()
    if channel is not None:
        channel.close()


def measure(transport: str, plan: StepPlan, steps: int, world_size: int = 2) -> dict:
    """One transport's per-step times in microseconds (rank 0's send; delivery to the other ranks)."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    channel = ShmBroadcast.create(world_size - 1) if transport == "shm" else None
    context = multiprocessing.get_context("spawn")
    readers = [context.Process(target=_reader, args=(rank, world_size, store.port,
                                                      channel and channel.name, steps + WARMUP_STEPS))
               for rank in range(1, world_size)]
    for reader in readers:
        reader.start()
    try:
        init_tensor_parallel(0, world_size, "cpu", store, channel=channel)
        if channel is not None:
            channel.unlink()
        send, send_cpu = [], []
        for _ in range(steps + WARMUP_STEPS):
            start, start_cpu = time.perf_counter(), time.thread_time()
            broadcast_control(("step", plan, start))
            send.append(time.perf_counter() - start)
            send_cpu.append(time.thread_time() - start_cpu)
            _step_sync()
        gathered: list = [None] * world_size
        dist.gather_object([], gathered, dst=0)
        delivery = [t for part in gathered[1:] for t in part]
    finally:
        destroy_tensor_parallel()
        for reader in readers:
            reader.join()
        if channel is not None:
            channel.close()

    def stats(seconds: list[float]) -> dict:
        micro = np.asarray(seconds) * 1e6
        return {"median_us": round(float(np.median(micro)), 1),
                "p90_us": round(float(np.percentile(micro, 90)), 1)}

    return {"transport": transport, "send": stats(send[WARMUP_STEPS:]),
            "send_cpu": stats(send_cpu[WARMUP_STEPS:]), "delivery": stats(delivery)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    args = parser.parse_args()
    plan = decode_plan(args.seqs, args.context, args.block_size)
    size = len(pickle.dumps(("step", plan, 0.0), protocol=pickle.HIGHEST_PROTOCOL))
    print(f"decode plan of {args.seqs} sequences x {args.context} tokens: {size / 1024:.1f} KiB pickled; "
          f"{args.world_size} ranks, {args.steps} steps, {os.cpu_count()} CPUs")
    print("microseconds per step: median / 90th percentile")
    print(f"{'transport':<10} {'rank 0 send':>16} {'rank 0 send CPU':>16} {'delivery':>16}")
    for transport in args.transports:
        r = measure(transport, plan, args.steps, args.world_size)
        cells = [f"{r[k]['median_us']:.0f} / {r[k]['p90_us']:.0f}" for k in ("send", "send_cpu", "delivery")]
        print(f"{transport:<10} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16}", flush=True)


if __name__ == "__main__":
    main()
