"""The nanovllm-mistral plugin's registration; its parity with transformers is in the top-level tests
(tests/test_parity_sliding.py)."""

from __future__ import annotations

from nanovllm.testing import assert_model_family_registered, assert_registration_imports_no_torch

ARCH = "MistralForCausalLM"


def test_entry_point_registers_the_architecture():
    from nanovllm_mistral.model import MistralForCausalLM

    assert_model_family_registered("nanovllm-mistral", ARCH, MistralForCausalLM)


def test_registering_imports_no_torch():
    assert_registration_imports_no_torch(ARCH)
