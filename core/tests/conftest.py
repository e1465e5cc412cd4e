"""Fixtures shared by the core tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model(tiny_model) -> str:
    """The tiny random Llama model's directory; a test that uses it is skipped without the nanovllm-llama plugin."""
    from nanovllm.plugins import get_plugins

    if "LlamaForCausalLM" not in get_plugins().registry.model_families:
        pytest.skip("needs the nanovllm-llama plugin")
    return tiny_model()
