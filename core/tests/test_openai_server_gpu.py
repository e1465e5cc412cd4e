"""The server over a tensor-parallel engine on two GPUs: a worker killed in the middle of a generation ends the
stream with an error within a bound, and /health answers 503. NCCL's collectives may wait for a dead rank;
the engine must not let a client wait with them. Skipped with fewer than two CUDA devices."""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import psutil  # noqa: E402
from nanovllm.testing import local_server, wait_until  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

MODEL = "tiny"
MAX_MODEL_LEN = 4096
BOUND = 60  # seconds from the kill to the stream's error event


def test_a_worker_killed_mid_generation_fails_the_stream_and_health(tiny_model):
    from nanovllm import AsyncLLM
    from nanovllm.entrypoints.openai_server import build_app

    # TP 2 divides the heads and KV heads; head size 32 takes the Triton backend, with CUDA graphs
    path = tiny_model("LlamaForCausalLM", initializer_range=0.3, num_attention_heads=4, num_key_value_heads=2,
                      hidden_size=128, intermediate_size=256)
    engine = AsyncLLM(path, tensor_parallel_size=2, kv_cache_memory=1 << 26, max_model_len=MAX_MODEL_LEN,
                      hf_overrides={"max_position_embeddings": MAX_MODEL_LEN})
    app = build_app(engine, MODEL)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True,
            "stream": True}
    events: list = []
    try:
        with local_server(app) as served:
            url = served.url
            (worker,) = [p for p in psutil.Process(engine._core.process.pid).children()
                         if not any("resource_tracker" in part for part in p.cmdline())]
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=BOUND)) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if len(events) == 2:  # generating: kill the worker in the middle of the steps
                        worker.send_signal(signal.SIGKILL)
                        killed = time.monotonic()
            ended = time.monotonic() - killed
            assert events[-1] == "[DONE]" and "error" in events[-2], events[-2:]
            assert events[-2]["error"]["code"] == 500 and "restart the server" in events[-2]["error"]["message"]
            assert ended < BOUND
            assert wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, 10)
    finally:
        app.state.preprocessor.close()
        engine.shutdown(10.0)  # kills an engine process stuck in a collective
