"""Whether FlashAttention-4 can run on this machine, found without importing torch, triton or flash_attn:
listing plugins stays light. :func:`probe` gathers the facts, :func:`unavailable_reason` judges them."""

from __future__ import annotations

import ctypes
import importlib.metadata as md
import os
from importlib.util import find_spec

import attrs

FA4_DIST = "flash-attn-4"
# FA4's paged-KV forward: SM 9.x (Hopper: flash_fwd_sm90) and SM 10.x/11.x (Blackwell). SM 8.x and 12.x
# have a forward without page tables.
PAGED_ARCH_MAJORS = (9, 10, 11)
INSTALL = "pip install 'nanovllm-flash-attn[fa4]' (or flash-attn-4[cu13] under a CUDA 13 PyTorch)"


@attrs.define(frozen=True)
class Machine:
    """What the backend needs, as found here."""

    fa4_version: str | None  # the flash-attn-4 distribution, None when not installed
    cutlass_found: bool  # the CuTe DSL's top-level package `cutlass` (from nvidia-cutlass-dsl)
    triton_found: bool  # the fallback kernels are the Triton backend's
    gpus: tuple[tuple[str, int, int], ...]  # visible NVIDIA GPUs: (name, major, minor)
    gpu_problem: str | None = None  # why no GPU could be listed (no driver, CUDA_VISIBLE_DEVICES="")


def unavailable_reason(machine: Machine) -> str | None:
    """``None`` when the backend can run, else every reason it cannot, each with its fix."""
    reasons = []
    if machine.fa4_version is None:
        reasons.append(f"FlashAttention-4 is not installed: {INSTALL}")
    elif not machine.cutlass_found:
        reasons.append(
            f"{FA4_DIST} {machine.fa4_version} is installed but the CuTe DSL is not importable (package "
            "cutlass, from nvidia-cutlass-dsl): install nvidia-cutlass-dsl; installed with pip --target, put "
            "its nvidia_cutlass_dsl/dsl_packages folder on PYTHONPATH too (only site-packages reads its .pth "
            "file)"
        )
    if not machine.triton_found:
        reasons.append("Triton is not installed (the shapes FA4 does not take run the triton backend): "
                       "pip install triton")
    if not machine.gpus:
        reasons.append(f"no NVIDIA GPU ({machine.gpu_problem or 'none listed'}): FA4 runs on CUDA devices; "
                       "use attention_backend='torch' on the CPU")
    elif not any(major in PAGED_ARCH_MAJORS for _, major, _ in machine.gpus):
        found = ", ".join(f"{name} (SM {major}.{minor})" for name, major, minor in machine.gpus)
        reasons.append(f"{found}: FA4's paged-KV forward needs SM 9.x (Hopper) or SM 10.x/11.x "
                       "(Blackwell); use attention_backend='triton'")
    return "; ".join(reasons) or None


def probe() -> Machine:
    """The facts on this machine: installed distributions, importable packages (found, not imported), and
    the GPUs NVML lists (NVML does not initialise CUDA, so forked processes stay free to)."""
    try:
        version = md.version(FA4_DIST)
    except md.PackageNotFoundError:
        version = None
    gpus, problem = _nvml_gpus()
    return Machine(version, find_spec("cutlass") is not None, find_spec("triton") is not None, gpus, problem)


def _nvml_gpus() -> tuple[tuple[tuple[str, int, int], ...], str | None]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return (), f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return (), "no NVIDIA driver: libnvidia-ml.so.1 not found"
    if nvml.nvmlInit_v2() != 0:
        return (), "the NVIDIA driver did not initialise (nvmlInit failed)"
    gpus = []
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return (), "NVML could not count the GPUs"
        for index in range(count.value):
            handle = ctypes.c_void_p()
            name = ctypes.create_string_buffer(96)
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                continue
            if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
                continue
            nvml.nvmlDeviceGetName(handle, name, ctypes.c_uint(len(name)))
            gpus.append((name.value.decode(errors="replace") or f"GPU {index}", major.value, minor.value))
    finally:
        nvml.nvmlShutdown()
    return tuple(gpus), None if gpus else "NVML lists no GPU"
