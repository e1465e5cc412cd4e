"""Which launches chain to the kernel before them (``nanovllm.dependent_launch``): kernels over at most
``CHAINED_LAUNCH_MAX_ROWS`` rows on CUDA devices of compute capability 9.0 and later, unless
``NANOVLLM_PDL=0``; never CPU tensors (the interpreter). Each chained kernel waits before anything else. The
GPU tests of the kernels and of the decode graphs run chained."""

from __future__ import annotations

import ast
import inspect
import textwrap
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from nanovllm import dependent_launch  # noqa: E402
from nanovllm.attention import triton_kernels  # noqa: E402
from nanovllm.kernel_sizes import CHAINED_LAUNCH_MAX_ROWS  # noqa: E402
from nanovllm.layers import fused_kernels, gemv_kernels  # noqa: E402

CHAINED = {"_rms_norm_kernel", "_gated_and_mul_kernel", "_rope_kernel", "_gemv_kernel", "_split_k_sum_kernel",
           "_decode_kernel", "_reduce_kernel"}


@pytest.fixture
def capability(monkeypatch):
    """Sets the GPU's compute capability that ``dependent_launch`` reads (its answer uncached around)."""
    def set_to(value: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: value)
        dependent_launch._enabled.cache_clear()

    yield set_to
    dependent_launch._enabled.cache_clear()


def cuda_rows(rows: int) -> SimpleNamespace:
    """A stand-in for a CUDA tensor of ``rows`` rows (what ``launch_options`` reads of one)."""
    return SimpleNamespace(is_cuda=True, shape=(rows, 8), device=torch.device("cuda", 0))


@pytest.mark.parametrize("gpu,variable,rows,chained", [
    ((9, 0), None, 1, True), ((10, 0), None, CHAINED_LAUNCH_MAX_ROWS, True),
    ((9, 0), None, CHAINED_LAUNCH_MAX_ROWS + 1, False), ((8, 9), None, 1, False), ((9, 0), "0", 1, False),
    ((9, 0), "1", 1, True),
])
def test_small_steps_on_hopper_and_later_chain_unless_turned_off(capability, monkeypatch, gpu, variable, rows,
                                                                  chained):
    if variable is None:
        monkeypatch.delenv(dependent_launch.VARIABLE, raising=False)
    else:
        monkeypatch.setenv(dependent_launch.VARIABLE, variable)
    capability(gpu)
    expected = {"PDL": True, "launch_pdl": True} if chained else {}
    assert dependent_launch.launch_options(cuda_rows(rows)) == expected


def test_cpu_tensors_never_chain(capability):
    capability((9, 0))
    assert dependent_launch.launch_options(torch.zeros(1)) == {}


def launch_sites(tree: ast.AST, name: str) -> list[list[ast.keyword]]:
    """The keywords of each launch of kernel ``name`` in a module's syntax tree: ``name[grid](...)``, or an
    entry ``(name, grid, args, dict(...))`` of a table of launches (the GEMV's)."""
    sites = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == name):
            sites.append(node.keywords)
        elif (isinstance(node, ast.Tuple) and node.elts and isinstance(node.elts[0], ast.Name)
              and node.elts[0].id == name and isinstance(node.elts[-1], ast.Call)):
            sites.append(node.elts[-1].keywords)
    return sites


def test_each_chained_kernel_waits_first_and_each_launch_site_chains():
    """A kernel with the ``PDL`` switch calls ``wait_for_previous(PDL)`` before any other statement (its
    docstring aside): no load or store may run before the kernel ahead of it has finished. Every launch of
    such a kernel passes ``**launch_options(...)``."""
    found = set()
    for module in (fused_kernels, gemv_kernels, triton_kernels):
        tree = ast.parse(inspect.getsource(module))
        kernels = [k for k in vars(module).values()
                   if "PDL" in getattr(k, "arg_names", ()) and k.fn.__module__ == module.__name__]
        for kernel in kernels:
            name = kernel.fn.__name__
            body = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0].body
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            assert ast.unparse(body[0]) == "wait_for_previous(PDL)", name
            sites = launch_sites(tree, name)
            assert sites, f"{name}: no launch found in {module.__name__}"
            for keywords in sites:
                spread = [ast.unparse(k.value) for k in keywords if k.arg is None]
                assert any(s.startswith("launch_options(") for s in spread), f"{name} launches unchained"
            found.add(name)
    assert found == CHAINED
