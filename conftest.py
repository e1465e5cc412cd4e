"""Shared fixtures for every test directory (core, plugins, cross-package)."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    """Under pytest-xdist each worker computes on one thread: the workers already fill the cores, and two
    OpenMP threads a worker spin badly on a busy 2-core machine."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_finish(session):
    """Without CUDA, the interpreter runs of the kernel tests' files (those with a test named
    ``*_under_interpreter``, which runs the file's ``interp`` cases) start now, in the background. Under
    pytest-xdist each worker collects every file but runs only some: each run then starts when its test
    does, on that test's worker."""
    import os

    import torch

    if (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
            or os.environ.get("PYTEST_XDIST_WORKER")):
        return
    from nanovllm.testing import start_interpreter_runs

    start_interpreter_runs(dict.fromkeys(i.path for i in session.items if i.name.endswith("_under_interpreter")))


def pytest_sessionfinish(session):
    from nanovllm.testing import stop_interpreter_runs

    stop_interpreter_runs()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model("Qwen3ForCausalLM", **overrides)`` -> path of a tiny random HF model (cached per session)."""
    from nanovllm.testing import tiny_model_dir

    made: dict[tuple, str] = {}

    def make(architecture: str = "LlamaForCausalLM", **overrides) -> str:
        key = (architecture, tuple(sorted(overrides.items(), key=lambda kv: kv[0])).__repr__())
        if key not in made:
            path = tmp_path_factory.mktemp(architecture)
            made[key] = str(tiny_model_dir(path, architecture, **overrides))
        return made[key]

    return make


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run far faster on one thread: two OpenMP threads spin badly on a busy 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
