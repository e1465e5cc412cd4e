"""Tensor-parallel workers: one process per rank other than 0, started by the engine with ``spawn``.

Rank 0 is the engine's own process: it schedules, broadcasts each step's plan on a shared-memory channel
that it creates and owns (:mod:`nanovllm.shm_broadcast`; it unlinks the name once every worker has
attached, so nothing is left in /dev/shm whoever crashes; on hosts that may reorder stores, the gloo control
group instead) and samples. A worker builds the same model
runner on its shard and follows rank 0's steps until told to stop. The world is wired through a TCP store
that rank 0 opens on a free port of 127.0.0.1; a worker writes its traceback there before it exits on an
error, so that the engine can say what went wrong. Workers leave when the engine's process does (they watch
their parent), and ignore Ctrl-C, which the engine handles.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from nanovllm.config import ResolvedConfig
from nanovllm.distributed import broadcast_control, destroy_tensor_parallel, init_tensor_parallel
from nanovllm.shm_broadcast import ShmBroadcast, stores_stay_in_order

# How long a worker may take to start (import torch and the plugins) and join the world.
START_TIMEOUT = datetime.timedelta(minutes=5)
STOP_TIMEOUT = 10.0  # seconds a worker may take to leave after the engine says stop
FAILURE_WAIT = 2.0  # seconds to wait for a worker's exit to show after it broke a collective
PARENT_POLL = 0.5  # seconds between a worker's checks that the engine's process is still there


def build_runner(config: ResolvedConfig):
    """This rank's model runner; the worker loads the plugins and resolves the selections itself."""
    from nanovllm.engine.model_loading import select_parts
    from nanovllm.engine.model_runner import ModelRunner
    from nanovllm.plugins import get_plugins

    return ModelRunner(config, select_parts(config, get_plugins(), config.observers))


def check_observers_travel(observers: tuple[object, ...], world_size: int) -> None:
    """Each worker gets the engine's observers pickled and imports their classes again: a clear error now
    for an observer object that cannot make the trip (selection strings always can)."""
    interactive = not getattr(sys.modules.get("__main__"), "__file__", None)
    for observer in observers:
        if isinstance(observer, (str, dict)):
            continue
        name = type(observer).__qualname__
        if type(observer).__module__ == "__main__" and interactive:
            raise ValueError(
                f"tensor_parallel_size={world_size} sends each observer to its worker processes, which "
                f"cannot import observer class {name!r}: it is defined in an interactive session. Define it "
                "in a module (a .py file) or the script you run, or register it and pass its selection string"
            )
        try:
            pickle.dumps(observer)
        except Exception as exc:
            raise ValueError(
                f"tensor_parallel_size={world_size} sends each observer to its worker processes by pickling "
                f"it, but observer {name!r} cannot be pickled ({exc}). Keep lambdas, locks and open files "
                "out of its attributes, or register it and pass its selection string"
            ) from exc


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL)
        os._exit(1)  # the engine's process is gone: nobody will send a step or stop

    threading.Thread(target=watch, name="nanovllm-parent-watch", daemon=True).start()


def _worker_main(rank: int, world_size: int, port: int, channel_name: str | None, config: ResolvedConfig,
                 parent_pid: int, num_threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent_pid)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=START_TIMEOUT)
    channel = None
    try:
        torch.set_num_threads(num_threads)
        if channel_name is not None:
            channel = ShmBroadcast.attach(channel_name, world_size - 1, rank - 1)
        store.set(f"joining/{rank}", "1")  # attached: rank 0 may unlink the channel's name
        init_tensor_parallel(rank, world_size, config.device, store, channel=channel)
        build_runner(config).follow()
        destroy_tensor_parallel()  # with rank 0, which told this rank to stop
    except BaseException:
        store.set(f"error/{rank}", traceback.format_exc())
        destroy_tensor_parallel(peers_gone=True)  # rank 0 will not leave the world with a failed rank
        raise SystemExit(1) from None
    finally:
        if channel is not None:
            channel.close()


class TPWorkers:
    """The engine's worker processes, ranks 1..world_size-1; rank 0 joins the world when they have."""

    def __init__(self, config: ResolvedConfig, world_size: int) -> None:
        self.world_size = world_size
        self.stopped = False
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                   timeout=START_TIMEOUT)
        processes: list[multiprocessing.Process] = []
        self.channel: ShmBroadcast | None = None  # None: steps go on the gloo control group
        if stores_stay_in_order():
            # a write that waits for a slot gives up if a worker is gone (it would never read it)
            self.channel = ShmBroadcast.create(
                world_size - 1, readers_alive=lambda: all(p.exitcode is None for p in processes))
        channel_name = None if self.channel is None else self.channel.name
        context = multiprocessing.get_context("spawn")
        processes.extend(
            context.Process(
                target=_worker_main, name=f"nanovllm-tp-rank{rank}", daemon=True,
                args=(rank, world_size, self.store.port, channel_name, config, os.getpid(),
                      torch.get_num_threads()),
            )
            for rank in range(1, world_size)
        )
        self.processes = processes
        try:
            for process in self.processes:
                process.start()
            self._wait_until_joining()
            if self.channel is not None:
                self.channel.unlink()  # every worker has it mapped: no name is left to leak from here on
            init_tensor_parallel(0, world_size, config.device, self.store, channel=self.channel)
        except BaseException:
            self.stop(graceful=False)
            raise

    def _wait_until_joining(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        waiting = set(range(1, self.world_size))
        while waiting:
            waiting = {rank for rank in waiting if not self.store.check([f"joining/{rank}"])}
            if self._failed():
                raise self.worker_failure()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel worker rank(s) {sorted(waiting)} did not start within "
                    f"{START_TIMEOUT.total_seconds():.0f} s; check that they can import nanovllm and torch"
                )
            time.sleep(0.02)

    def dead(self) -> list[multiprocessing.Process]:
        return [p for p in self.processes if p.exitcode is not None]

    def _failed(self) -> bool:
        return bool(self.dead()) or any(self.store.check([f"error/{r}"]) for r in range(1, self.world_size))

    def worker_failure(self, wait: float = FAILURE_WAIT) -> RuntimeError | None:
        """A clear error naming the workers that failed or exited, with their tracebacks; None if none
        did within ``wait`` seconds (a dead peer breaks rank 0's collective just before its exit shows)."""
        deadline = time.monotonic() + wait
        while not self._failed() and time.monotonic() < deadline:
            time.sleep(0.02)
        lines = []
        for rank, process in enumerate(self.processes, start=1):
            failed = self.store.check([f"error/{rank}"])
            if process.exitcode is None and not failed:
                continue
            code = process.exitcode
            if code is None:
                how = "raised an error"
            elif code < 0:
                how = f"was killed by signal {signal.Signals(-code).name}"
            else:
                how = f"exited with code {code}"
            lines.append(f"tensor-parallel worker rank {rank} (pid {process.pid}) {how}")
            if failed:
                lines.append(self.store.get(f"error/{rank}").decode().rstrip())
        if not lines:
            return None
        lines.append("the engine's tensor-parallel world is stopped: create a new engine")
        return RuntimeError("\n".join(lines))

    def failure(self, cause: BaseException) -> RuntimeError:
        """The error of a failed start or step: a worker's, else rank 0's ``cause``."""
        return self.worker_failure() or RuntimeError(
            f"a tensor-parallel step failed on rank 0 ({type(cause).__name__}: {cause}); the ranks are out "
            "of step, so the engine's tensor-parallel world is stopped: create a new engine"
        )

    def stop(self, graceful: bool = True) -> None:
        """Tell the workers to stop, leave the world with them, and wait for them (``graceful``; after a
        failed step they are out of step and are killed at once, as are those that do not leave in time)."""
        if self.stopped:
            return
        self.stopped = True
        told = False
        if graceful and dist.is_initialized() and all(p.is_alive() for p in self.processes):
            try:
                broadcast_control(("stop",))
                told = True
            except RuntimeError:  # a worker died under the broadcast; the others are killed below
                pass
        if told:  # the workers leave the world now too: NCCL's shutdown waits for every rank's
            destroy_tensor_parallel()
        for process in self.processes:
            if process.pid is None:  # never started
                continue
            process.join(STOP_TIMEOUT if told else 0)
            if process.is_alive():
                process.kill()
                process.join()
        if not told:
            destroy_tensor_parallel(peers_gone=True)
        if self.channel is not None:
            self.channel.close()
