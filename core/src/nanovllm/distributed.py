"""Tensor-parallel rank and size: from torch.distributed when it is initialised, else a single rank.

A tensor-parallel world has two process groups: the default one (NCCL on CUDA, gloo on the CPU) for the
model's all-reduces and gathers, and a gloo control group for the host's collectives (the smallest KV cache,
barriers). Rank 0 broadcasts each step's inputs to the other ranks on the control channel: a shared-memory
ring (:mod:`nanovllm.shm_broadcast`) when the engine started the ranks on its own host, else (``torchrun``,
possibly several hosts) the gloo control group, whose long timeout lets the other ranks wait for the next
step for as long as the engine is idle.
"""

from __future__ import annotations

import datetime
import os
import socket
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nanovllm.shm_broadcast import ShmBroadcast

# Idle workers wait on the control group for the next step: as long as the engine lives.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
# The model's collectives run inside a step; a rank that does not join within this is gone.
DATA_TIMEOUT = datetime.timedelta(minutes=10)

_control_group: dist.ProcessGroup | None = None
_control_channel: ShmBroadcast | None = None  # the step broadcast of ranks on one host
# Run before the world is left: NCCL cannot destroy a communicator that a live CUDA graph captured (it
# waits for the graph, forever), so whoever captured collectives registers the graphs' release here.
_before_destroy: list[weakref.WeakMethod] = []
_symmetric: SymmetricAllReduce | None = None  # small all-reduces, when the GPUs allow
_rendezvous_count = 0  # symmetric-memory rendezvous this process has begun


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks (``x`` itself, or a new tensor: use the result)."""
    if tp_size() > 1:
        if _symmetric is not None and _symmetric.takes(x):
            return _symmetric(x)
        dist.all_reduce(x)
    return x


def all_reduce_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None = None):
    """``RMSNorm`` of the sum over the ranks of ``x``, in one kernel through symmetric memory
    (:meth:`SymmetricAllReduce.rms_norm`); None where that path does not take ``x``: the caller all-reduces,
    then norms."""
    if _symmetric is None or not _symmetric.takes_rows(x):
        return None
    return _symmetric.rms_norm(x, weight, eps, residual)


SYMMETRIC_VARIABLE = "NANOVLLM_SYMMETRIC_ALL_REDUCE"  # "0": every all-reduce goes through NCCL


class SymmetricAllReduce:
    """All-reduces of small tensors through PyTorch's symmetric memory: every rank copies its input into a
    buffer that the other GPUs of the host map (peer to peer), then each rank reads and sums every rank's
    copy itself, in one kernel. A decode step's all-reduces are a few KB, where NCCL's ring pays its
    latency twice; NVLink multicast is not used. Larger tensors (prefill) stay on NCCL.

    The same buffer serves :meth:`rms_norm`: the all-reduce of a row-parallel layer's output fused with the
    RMSNorm that follows it (one kernel of ours instead of PyTorch's all-reduce and the norm), in a region
    of its own with its own flags."""

    BUFFER_BYTES = 4 << 20  # two-shot up to this; a B1 decode step's [256, 4096] bf16 is 2 MiB
    ONE_SHOT_MAX_BYTES = 512 << 10  # one-shot: each rank reads every peer's whole tensor
    NORM_SLOT_BYTES = 4 << 20  # a region of the fused norm's slots, one per rank: [512, 4096] bf16
    NORM_PROGRAMS = 128  # the fused norm's fixed grid: each program's flags count its calls

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.rank = tp_rank()
        itemsize = dtype.itemsize
        flag_bytes = self.NORM_PROGRAMS * tp_size() * 4
        norm_bytes = 2 * tp_size() * self.NORM_SLOT_BYTES  # two slots of a region per rank
        total = self.BUFFER_BYTES + norm_bytes + flag_bytes
        self.flags_offset = self.BUFFER_BYTES + norm_bytes  # bytes
        whole = symm_mem.empty(total // itemsize, dtype=dtype, device=device)
        whole.view(torch.uint8)[self.flags_offset :].zero_()
        torch.cuda.synchronize(device)  # zero before the rendezvous, which every rank must reach
        handle = symm_mem.rendezvous(whole, self.group_name)
        if handle.buffer_ptrs[self.rank] != whole.data_ptr():
            raise RuntimeError("the symmetric buffer does not start where PyTorch says it does")
        self.buffer = whole[: self.BUFFER_BYTES // itemsize]
        self.norm_offset = self.BUFFER_BYTES // itemsize  # elements
        self.norm_slot = self.NORM_SLOT_BYTES // itemsize
        self.addresses = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.epochs = torch.zeros(self.NORM_PROGRAMS, dtype=torch.int32, device=device)

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype == self.buffer.dtype and x.numel() <= self.buffer.numel() and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staging = self.buffer[: x.numel()].view_as(x)
        out = torch.empty_like(x)
        if x.numel() * x.element_size() <= self.ONE_SHOT_MAX_BYTES:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", self.group_name, out)
        else:  # reduce-scatter then all-gather, each rank moving a 1/world share
            staging.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(staging, "sum", self.group_name, out)
        return out

    def takes_rows(self, x: torch.Tensor) -> bool:
        """Whether :meth:`rms_norm` takes ``x`` (the same answer on every rank: it depends on shapes)."""
        return (x.dtype == self.buffer.dtype and x.dim() == 2 and x.is_contiguous()
                and x.numel() <= self.norm_slot and x.shape[-1] <= 16384)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                 timeout_s: float = DATA_TIMEOUT.total_seconds()):
        from nanovllm.layers.fused import kernels

        return kernels().all_reduce_rms_norm(x, weight, eps, residual, self.addresses, self.epochs, self.rank,
                                             self.norm_offset, self.norm_slot, self.flags_offset,
                                             timeout_s=timeout_s)


def enable_symmetric_all_reduce(dtype: torch.dtype, device: torch.device) -> str | None:
    """Every rank calls this together once it holds its GPU: small all-reduces of ``dtype`` then go through
    :class:`SymmetricAllReduce`. Returns why they stay on NCCL (None: they do not). It needs every rank on
    one host with peer access between their GPUs, a process that has not set up symmetric memory before,
    and a test sum that comes out right on every rank."""
    global _symmetric, _rendezvous_count
    if tp_size() == 1 or device.type != "cuda":
        return "one rank" if tp_size() == 1 else f"on {device.type}, not CUDA"
    places: list[Any] = [None] * tp_size()
    here = (socket.gethostname(), gpu_uuid(torch.cuda.current_device()), _rendezvous_count)
    dist.all_gather_object(places, here, group=_control_group)
    if os.environ.get(SYMMETRIC_VARIABLE, "1") == "0":
        reason = f"{SYMMETRIC_VARIABLE}=0"
    else:
        reason = peer_problem([(host, gpu) for host, gpu, _ in places])
    if reason is None and any(count for _, _, count in places):
        # PyTorch numbers a process's rendezvous, not a group's (pytorch#196082): a later engine's fresh
        # workers would wait on keys rank 0 never writes. Only processes new to it take part.
        reason = "an earlier tensor-parallel engine in this process used symmetric memory (pytorch#196082)"
    if agree_min(int(reason is None)) == 1:
        try:
            _rendezvous_count += 1
            _symmetric = SymmetricAllReduce(dtype, device)
        except Exception as exc:  # noqa: BLE001 -- whatever it is, NCCL still works
            reason = f"{type(exc).__name__}: {exc}"
        if agree_min(int(reason is None)) == 1:  # every rank holds the buffer: test it together
            total = all_reduce(torch.full((1024,), tp_rank() + 1.0, dtype=dtype, device=device))
            if not bool((total == tp_size() * (tp_size() + 1) / 2).all()):
                reason = "a test sum came out wrong"
            shares = torch.full((2, 512), tp_rank() + 1.0, dtype=dtype, device=device)
            try:  # the ranks' flags must cross between the GPUs: a rank that waits a minute traps
                normed = _symmetric.rms_norm(shares, torch.full((512,), 2.0, dtype=dtype, device=device), 0.0,
                                             None, timeout_s=60.0)
                worst = float((normed.float() - 2.0).abs().max())
            except RuntimeError as exc:
                raise RuntimeError(
                    f"tensor-parallel rank {tp_rank()}: the all-reduce fused with RMSNorm failed its "
                    f"start-up test over symmetric memory ({exc}); set {SYMMETRIC_VARIABLE}=0 to keep "
                    "every all-reduce on NCCL"
                ) from exc
            if reason is None and worst > 0.02:
                reason = "a test sum and norm came out wrong"
        if agree_min(int(reason is None)) == 0:
            reason = reason or "another rank could not use it"
    if reason is not None:
        _symmetric = None
    return reason


def gpu_uuid(index: int) -> str:
    """The GPU's UUID: the same GPU has it in every process, whatever CUDA_VISIBLE_DEVICES numbers it."""
    return str(torch.cuda.get_device_properties(index).uuid)


def peer_problem(places: list[tuple[str, str]]) -> str | None:
    """Why this process cannot map the memory of the ranks' GPUs (``(host, GPU UUID)`` per rank), or None.
    torchrun nodes on one host, each with its own CUDA_VISIBLE_DEVICES, see one host but not each other's
    GPUs, as if on several hosts."""
    if len({host for host, _ in places}) > 1:
        return "the ranks are on several hosts"
    visible = {gpu_uuid(i): i for i in range(torch.cuda.device_count())}
    if any(gpu not in visible for _, gpu in places):
        return "some ranks' GPUs are not visible to the others (CUDA_VISIBLE_DEVICES differs between them)"
    here = torch.cuda.current_device()
    if not all(visible[gpu] == here or torch.cuda.can_device_access_peer(here, visible[gpu]) for _, gpu in places):
        return "the GPUs have no peer access to each other"
    return None


def init_tensor_parallel(rank: int, world_size: int, device_type: str, store: dist.Store | None = None,
                         local_rank: int | None = None, channel: ShmBroadcast | None = None) -> None:
    """Join the tensor-parallel world (``store`` given: the engine's own workers; else ``torchrun``'s
    environment, MASTER_ADDR and MASTER_PORT) and make the control group; ``channel``: the shared-memory
    step broadcast of ranks on one host (its owner closes it), else steps go on the control group. On CUDA
    the rank takes GPU ``local_rank`` of its host (default: ``rank % device_count``, all ranks on one host)."""
    global _control_group, _control_channel
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count() if local_rank is None else local_rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=DATA_TIMEOUT)
    _control_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _control_channel = channel


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_ranks(tensor_parallel_size: int) -> tuple[int, int]:
    """This process's rank and local rank from the environment ``torchrun`` sets, checked against
    ``tensor_parallel_size``; an error that says what to run when the environment is missing."""
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"distributed_executor_backend='external_launcher' needs the environment torchrun sets ({', '.join(missing)} "
            f"missing): start the script with `torchrun --nproc-per-node {tensor_parallel_size} script.py`, or leave "
            "the option unset for the engine to start its own ranks"
        )
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != tensor_parallel_size:
        raise ValueError(
            f"torchrun started WORLD_SIZE={world_size} ranks but tensor_parallel_size={tensor_parallel_size}; with "
            "distributed_executor_backend='external_launcher' every rank is one tensor-parallel rank, so make them equal"
        )
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])


def release_before_destroy(release: Callable[[], None]) -> None:
    """Call the bound method ``release`` before this rank leaves the world (held weakly)."""
    _before_destroy.append(weakref.WeakMethod(release))


def destroy_tensor_parallel(peers_gone: bool = False) -> None:
    """Leave the world. NCCL's shutdown waits for every rank to shut down too, so ranks that stop together
    call this together; ``peers_gone``: some ranks died or were killed, and NCCL's communicators are
    aborted instead, which waits for no one."""
    global _control_group, _control_channel, _symmetric
    while _before_destroy:
        release = _before_destroy.pop()()
        if release is not None:
            release()
    _control_group = _control_channel = _symmetric = None
    if dist.is_available() and dist.is_initialized():
        if peers_gone and dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()


def broadcast_control(message: Any = None) -> Any:
    """Rank 0 sends ``message`` (any picklable object) to every rank; every rank returns it."""
    if _control_channel is not None:
        if tp_rank() == 0:
            _control_channel.write(message)
            return message
        return _control_channel.read()
    box = [message]
    dist.broadcast_object_list(box, src=0, group=_control_group)
    return box[0]


def agree_min(value: int) -> int:
    """The smallest ``value`` of all ranks (e.g. the KV blocks every rank can hold)."""
    if tp_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_control_group)
    return int(tensor.item())


def barrier() -> None:
    """Wait for every rank on the control group; a rank that died raises here, on the host."""
    if tp_size() > 1:
        dist.barrier(group=_control_group)


def barrier_within(seconds: float) -> None:
    """Rank 0 waits at most ``seconds`` for every other rank to reach this barrier (a RuntimeError naming
    the late ranks after that); the other ranks wait for rank 0 as long as it takes."""
    if tp_size() > 1:
        dist.monitored_barrier(group=_control_group, timeout=datetime.timedelta(seconds=seconds),
                               wait_all_ranks=True)


def capture_problem() -> str | None:
    """Why this world's collectives cannot be captured in CUDA graphs, or None when they can."""
    if tp_size() == 1:
        return None
    version = tuple(torch.cuda.nccl.version())[:3]
    if version < (2, 9, 6):  # NCCL captures its collectives from 2.9.6 on
        return f"NCCL {'.'.join(map(str, version))} cannot capture collectives in CUDA graphs (2.9.6 can)"
    return None
