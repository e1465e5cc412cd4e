"""``attention_backend="auto"``: the measured table it orders backends by, and the checks that pass a backend
over (not installed or unavailable, wrong device, dtype or head size, a missing feature). A CUDA device is
stood in for on the CPU by its compute capability; the backends are only loaded, never run."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.engine import backend_table
from nanovllm.engine.backend_table import MEASURED, TIE, MeasuredFamily, fastest
from nanovllm.engine.model_loading import (AUTO_BACKENDS, BackendNeeds, auto_order, make_auto_backend, make_backend,
                                          usable_backends)
from nanovllm.plugins import AttentionBackendInfo, reload_plugins
from nanovllm.selection import BackendChoice

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")
LOGGER = "nanovllm.engine.model_loading"


class FakeFlashAttn(TorchBackend):
    """Stands for an available ``flash_attn`` backend: every operation, windows, CUDA graphs."""

    name = "flash_attn"
    supports_cuda_graphs = True


class NoWindow(FakeFlashAttn):
    def prefill(self, q, k, v, k_cache, v_cache, meta, scale):
        return super().prefill(q, k, v, k_cache, v_cache, meta, scale)

    def decode(self, q, k_cache, v_cache, meta, scale):
        return super().decode(q, k_cache, v_cache, meta, scale)


class NoGraphs(FakeFlashAttn):
    supports_cuda_graphs = False


class KernelsFailToImport(FakeFlashAttn):
    def __init__(self, config=None) -> None:
        raise ImportError("FA4's kernels do not import: reinstall flash-attn-4")


class NoSparseOps(AttentionBackend):
    """Prefill and decode only: no attend_blocks or attend_chunk for sparse policies and offload."""

    name = "flash_attn"
    supports_cuda_graphs = True
    store_kv, prefill, decode = TorchBackend.store_kv, TorchBackend.prefill, TorchBackend.decode


@pytest.fixture
def plugins():
    yield reload_plugins()
    reload_plugins()


@pytest.fixture
def gpu(monkeypatch):
    """Make ``torch.cuda.get_device_capability`` report ``(major, minor)``."""
    def set_capability(major: int, minor: int) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
    return set_capability


def install_flash_attn(plugins, cls: type) -> None:
    """Register ``cls`` as an available ``flash_attn`` backend in place of whatever is installed."""
    plugins.registry.attention_backends["flash_attn"] = AttentionBackendInfo(
        "flash_attn", f"{__name__}:{cls.__name__}", "test", devices=("cuda",), dtypes=("float16", "bfloat16"))


def chosen(plugins, needs: BackendNeeds) -> str:
    return make_auto_backend(plugins, needs).name


def test_unavailable_flash_attn_is_passed_over_for_triton_with_its_reason(plugins, gpu, caplog):
    pytest.importorskip("triton")
    gpu(9, 0)
    info = plugins.registry.attention_backends.get("flash_attn")
    assert info is None or info.unavailable  # no FA4 or GPU here
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert chosen(plugins, BackendNeeds(CUDA, torch.bfloat16, 128)) == "triton"
    reason = "not installed" if info is None else re.escape(info.unavailable)
    assert re.search(rf"chose 'triton': among the fastest in \d+ of the \d+ shapes measured on sm_90 "
                     rf"\(benchmarks/results/h200_kernel_peers.json\); passed over flash_attn: .*{reason}", caplog.text)


def test_a_backend_that_cannot_keep_an_8bit_cache_is_passed_over_for_one_that_can(plugins, gpu, caplog):
    pytest.importorskip("triton")
    gpu(9, 0)
    install_flash_attn(plugins, FakeFlashAttn)  # registered with the default kv_cache_dtypes: the model's only
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert chosen(plugins, BackendNeeds(CUDA, torch.bfloat16, 128, kv_cache_dtype="fp8_e4m3")) == "triton"
    assert "passed over flash_attn: kv_cache_dtype fp8_e4m3 is not among auto" in caplog.text
    assert chosen(plugins, BackendNeeds(CUDA, torch.bfloat16, 128)) == "flash_attn"


def test_an_available_flash_attn_is_chosen_where_it_measured_fastest(plugins, gpu, caplog):
    pytest.importorskip("triton")
    gpu(9, 0)
    install_flash_attn(plugins, FakeFlashAttn)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert chosen(plugins, BackendNeeds(CUDA, torch.bfloat16, 128)) == "flash_attn"
    wins = MEASURED["sm_90"].wins("flash_attn")
    assert f"chose 'flash_attn': among the fastest in {wins} of the" in caplog.text
    assert chosen(plugins, BackendNeeds(CUDA, torch.float32, 128)) == "triton"  # a dtype it does not take


def test_a_gpu_family_never_measured_keeps_the_fallback_order(plugins, gpu, caplog):
    pytest.importorskip("triton")
    gpu(8, 0)
    install_flash_attn(plugins, FakeFlashAttn)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert chosen(plugins, BackendNeeds(CUDA, torch.bfloat16, 128)) == "triton"
    assert "nothing measured on sm_80" in caplog.text


@pytest.mark.parametrize("cls, needs_window, lacks", [
    (NoWindow, True, "lacks a sliding window"),
    (NoSparseOps, False, "lacks attend_blocks, attend_chunk"),
    (KernelsFailToImport, False, "FA4's kernels do not import: reinstall flash-attn-4"),
])
def test_a_backend_lacking_a_needed_feature_is_never_chosen(plugins, gpu, caplog, cls, needs_window, lacks):
    pytest.importorskip("triton")
    gpu(9, 0)
    install_flash_attn(plugins, cls)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert chosen(plugins, BackendNeeds(CUDA, torch.bfloat16, 128, windowed=needs_window)) == "triton"
    assert f"passed over flash_attn: {lacks}" in caplog.text


def test_without_a_window_need_a_windowless_backend_is_fine(plugins, gpu):
    pytest.importorskip("triton")
    gpu(9, 0)
    install_flash_attn(plugins, NoWindow)
    assert chosen(plugins, BackendNeeds(CUDA, torch.bfloat16, 128, windowed=False)) == "flash_attn"


def test_on_cuda_a_backend_that_captures_graphs_comes_first(plugins, gpu):
    pytest.importorskip("triton")
    gpu(9, 0)
    install_flash_attn(plugins, NoGraphs)
    assert chosen(plugins, BackendNeeds(CUDA, torch.bfloat16, 128)) == "triton"
    del plugins.registry.attention_backends["triton"]
    assert chosen(plugins, BackendNeeds(CUDA, torch.bfloat16, 128)) == "flash_attn"  # eager beats nothing


def test_on_the_cpu_auto_makes_the_torch_backend(plugins, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        backend = make_backend(BackendChoice(None), plugins, torch.device("cpu"), torch.float32, 64, windowed=True)
    assert isinstance(backend, TorchBackend)
    assert "chose 'torch': nothing measured on cpu, so the first usable of triton, torch" in caplog.text
    assert "passed over triton: device cpu is not among cuda" in caplog.text


def test_no_usable_backend_names_every_reason(plugins):
    del plugins.registry.attention_backends["torch"]
    with pytest.raises(ValueError, match=r"found no usable backend for device cpu, dtype float32, head size 64: "
                                         r"triton: device cpu is not among cuda; torch: not installed"):
        make_auto_backend(plugins, BackendNeeds(torch.device("cpu"), torch.float32, 64))


@pytest.mark.gpu
def test_on_this_gpu_auto_makes_the_first_usable_backend_of_the_table(plugins, caplog):
    """With FA4 installed on an SM 9.0 GPU that is ``flash_attn``; else ``triton``."""
    needs = BackendNeeds(CUDA, torch.bfloat16, 128)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        backend = make_auto_backend(plugins, needs)
    info = plugins.registry.attention_backends.get("flash_attn")
    fa4_ready = info is not None and info.unavailable is None
    expected = "flash_attn" if fa4_ready and auto_order(CUDA)[1] == "sm_90" else "triton"
    assert backend.name == expected == usable_backends(plugins, needs)[0][0][0]
    print(caplog.text)  # the choice and what was passed over, for the run's log


# -- the table ------------------------------------------------------------------------------------------------


def test_fastest_keeps_the_ties_fastest_first():
    assert fastest({"a": 100.0, "b": 101.0, "c": 101.0 * (1 - TIE) - 0.01}) == ("b", "a")
    assert fastest({"a": 1.0}) == ("a",) and fastest({}) == ()


def test_ranking_counts_the_shapes_each_backend_is_among_the_fastest():
    family = MeasuredFamily("x.json", {("prefill", "4K"): ("b",), ("decode", "1"): ("a", "b"),
                                       ("decode", "2"): ("a",), ("decode", "3"): ("c", "a")})
    assert family.ranking() == ("a", "b", "c") and family.wins("b") == 2 and family.wins("d") == 0


def test_device_family_names_the_compute_capability():
    assert backend_table.device_family(9, 0) == "sm_90" and backend_table.device_family(10, 0) == "sm_100"


def test_sm_90_entries_are_those_of_their_run():
    """Each entry, recomputed from the peer-table rows of the results file it names: every prefill and
    decode shape, the ``triton`` and ``flash_attn`` backends each through its own ``prefill`` and ``decode``."""
    measured = MEASURED["sm_90"]
    results = json.loads((ROOT / measured.results).read_text())
    assert "H200" in results["environment"]["device"] or "H100" in results["environment"]["device"]  # SM 9.0
    [kernels] = results["results"]
    derived: dict[tuple[str, str], dict[str, float]] = {}
    for r in kernels["rows"]:
        backend = r.get("backend")
        if backend in ("triton", "flash_attn"):
            derived.setdefault((r["kind"], r["shape"]), {})[backend] = r["value"]
    assert len(derived) >= 20 and all(len(values) == 2 for values in derived.values())
    assert dict(measured.fastest) == {key: fastest(values) for key, values in derived.items()}
    assert measured.ranking()[0] == "flash_attn" and set(AUTO_BACKENDS) <= {"triton", "torch"}


def test_peer_rows_are_ranked_against_the_best_of_their_shape():
    pytest.importorskip("triton")
    from nanovllm.bench.kernels import rank_rows

    def row(shape, value, kind="prefill"):
        return {"kind": kind, "shape": shape, "value": value}
    rows = [row("4K", 500.0), row("4K", 250.0), row("16K", 600.0), row("16K", float("nan")), row("4K", 1.0, "decode"),
            {"kind": "copy", "value": 4000.0}]
    rank_rows(rows)
    assert [r.get("of_best") for r in rows] == [1.0, 0.5, 1.0, None, 1.0, None]
