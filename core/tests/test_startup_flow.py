"""Start-up flows one way: ``LLM(...)`` -> ``LLMEngine`` resolves the options once, then hands the resolved
config down to the tensor-parallel world, the model runner and its parts. Traced with ``sys.setprofile``
over the set-up modules (``nanovllm.llm``, ``nanovllm.config``, ``nanovllm.engine.*``)."""

from __future__ import annotations

import sys
from collections import Counter

SETUP_MODULES = ("nanovllm.llm", "nanovllm.config", "nanovllm.engine.")
RESOLVING_MODULES = ("nanovllm.engine.model_loading",)  # where the options are resolved (config.py: the data)
BELOW_THE_ENGINE = ("nanovllm.engine.tp_world", "nanovllm.engine.model_runner", "nanovllm.engine.cuda_graphs",
                    "nanovllm.engine.kv_allocation", "nanovllm.engine.sampling_inputs")


def trace_start(start) -> tuple[Counter, Counter, object]:
    """Run ``start()``; count the calls between set-up modules that go back up to a module on the call
    stack, and the calls from below the engine into the modules that resolved the options."""
    stack: list[str] = []
    up: Counter = Counter()
    back: Counter = Counter()

    def profile(frame, event, _arg) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            caller = stack[-1] if stack else ""
            if module.startswith(SETUP_MODULES) and caller.startswith(SETUP_MODULES) and module != caller:
                if module in stack:
                    up[f"{caller} -> {module}.{frame.f_code.co_name}"] += 1
                if caller.startswith(BELOW_THE_ENGINE) and module.startswith(RESOLVING_MODULES) \
                        and not frame.f_code.co_name.startswith("__"):
                    back[f"{caller} -> {module}.{frame.f_code.co_name}"] += 1
            stack.append(module)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        result = start()
    finally:
        sys.setprofile(None)
    return up, back, result


def test_the_options_travel_one_way_from_llm_to_the_runner(tiny_model):
    from nanovllm import LLM

    path = tiny_model()
    up, back, llm = trace_start(lambda: LLM(path, device="cpu", kv_cache_memory=1 << 24, max_model_len=64))
    assert llm.runner.config is llm.llm_engine.config
    assert not up, f"set-up calls back up to a module on the call stack: {dict(up)}"
    # building the model and binding its attention: the runner's only calls to where the options were resolved
    assert back, "the trace saw no call from the runner into model_loading: it traces nothing"
    assert sum(back.values()) <= 2, f"calls back to the modules that resolved the options: {dict(back)}"
