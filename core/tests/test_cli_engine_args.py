"""One definition of the engine options for every command (``generate``, ``chat``, ``serve``), the model
as a positional argument of ``serve`` and ``chat``, ``nanovllm chat`` on the terminal, and ``--version``."""

from __future__ import annotations

import io

import attrs
import pytest
from nanovllm import __version__, cli
from nanovllm.config import EngineConfig

FLAGS = {  # a value for every engine option, as a user would type it, and what LLM(...) should get
    "--dtype": ("float32", "float32"), "--max-model-len": ("128", 128), "--max-num-seqs": ("4", 4),
    "--max-num-batched-tokens": ("256", 256), "--gpu-memory-utilization": ("0.5", 0.5),
    "--kv-cache-memory": ("1048576", 1 << 20), "--block-size": ("8", 8),
    "--kv-cache-dtype": ("fp8", "fp8"), "--no-enable-prefix-caching": (None, False),
    "--no-enable-chunked-prefill": (None, False), "--enforce-eager": (None, True),
    "--disable-hybrid-kv-cache-manager": (None, True),
    "--no-async-scheduling": (None, False), "--enable-triton-gemv": (None, True),
    "--no-piecewise-cuda-graphs": (None, False),
    "--kv-offloading-size": ("2.5", 2.5),
    "--kv-offloading-buffer-size": ("0.5", 0.5), "--no-kv-offloading-reuse-selections": (None, False),
    "--tensor-parallel-size": ("2", 2),
    "--distributed-executor-backend": ("external_launcher", "external_launcher"), "--device": ("cpu", "cpu"),
    "--seed": ("7", 7), "--load-format": ("dummy", "dummy"), "--skip-tokenizer-init": (None, True),
    "--sparse-policy": ("quest:token_budget=64", "quest:token_budget=64"), "--attention-backend": ("torch", "torch"),
    "--hf-overrides": ('{"max_position_embeddings": 64}', '{"max_position_embeddings": 64}'),
    "--max-logprobs": ("5", 5), "--tokenizer": ("some/tokenizer", "some/tokenizer"), "--revision": ("v1", "v1"),
    "--tokenizer-revision": ("v2", "v2"), "--download-dir": ("/tmp/hub", "/tmp/hub"),
    "--trust-remote-code": (None, True),
}


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve", "some/model"], ["chat", "some/model"]])
def test_every_engine_option_is_a_flag_of_every_command(command):
    from nanovllm.engine_args import engine_kwargs

    argv = [command[0]]
    for flag, (value, _) in FLAGS.items():
        argv += [flag] if value is None else [flag, value]
    args = cli.build_parser().parse_args(argv + command[1:])
    kwargs = engine_kwargs(args)
    names = {f.name for f in attrs.fields(EngineConfig)} - {"model"}
    # every option of EngineConfig is covered here, so a new option cannot silently miss its flag
    assert {flag.lstrip("-").removeprefix("no-").replace("-", "_") for flag in FLAGS} == names
    assert kwargs == {flag.lstrip("-").removeprefix("no-").replace("-", "_"): want for flag, (_, want) in FLAGS.items()}
    EngineConfig.from_kwargs(None, kwargs)  # what the flags give, LLM(...) accepts
    if command[0] != "generate":
        assert args.model == "some/model"


def test_flags_left_out_keep_the_engine_defaults():
    from nanovllm.engine_args import engine_kwargs

    assert engine_kwargs(cli.build_parser().parse_args(["serve"])) == {}
    assert cli.build_parser().parse_args(["generate", "--model", "m", "hi"]).model == "m"


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"nanovllm {__version__}"


def test_serve_builds_the_engine_from_the_flags(tiny_model, monkeypatch, one_thread):
    pytest.importorskip("fastapi")
    from nanovllm.entrypoints import openai_server

    got = {}

    def fake_serve(llm, name, host, port, api_key, log_level, **options):
        got.update(llm=llm, name=name, host=host, port=port, api_key=api_key, **options)
        llm.shutdown()

    monkeypatch.setattr(openai_server, "serve", fake_serve)
    model = tiny_model()
    argv = ["serve", model, "--device", "cpu", "--max-model-len", "48", "--port", "8123", "--api-key", "k",
            "--no-engine-process", "--shutdown-timeout", "2.5"]  # the engine on a thread, to look at it here
    assert cli.main(argv) == 0
    assert got["name"] == model and got["port"] == 8123 and got["api_key"] == "k" and got["host"] == "127.0.0.1"
    assert got["shutdown_timeout"] == 2.5 and got["max_json_body_size"] == 32 << 20
    assert got["llm"].engine.max_model_len == 48 and got["llm"].engine.config.device == "cpu"


def test_chat_streams_a_conversation(monkeypatch, capsys, one_thread):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi there\nAnd again\n\n"))
    assert cli.main(["chat", "--device", "cpu", "--max-tokens", "3", "--temperature", "0",
                     "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    prompts = out.split("> ")
    assert len(prompts) == 4 and prompts[0] == "" and prompts[-1] == ""  # two answers, then the empty line
    assert all(p.strip() for p in prompts[1:3])
