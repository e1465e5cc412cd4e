"""The engine options as command-line flags, in one place: every field of :class:`~nanovllm.config.EngineConfig`
becomes ``--field-name``, and the flags given turn back into ``LLM`` keyword arguments. ``generate``, ``serve``
and ``chat`` all take them, so a new engine option is a flag everywhere at once. :class:`EngineArgs` is the
same definition in vLLM's shape, for scripts written for vLLM. Imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import attrs

from nanovllm.config import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES, EngineConfig

# flags whose values argparse itself can check, so a typo is a usage error before anything loads
CHOICES = {"device": ("auto", "cpu", "cuda"), "load_format": ("auto", "dummy"),
           "distributed_executor_backend": ("mp", "external_launcher"),
           "kv_cache_dtype": (*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES)}
EXAMPLES = {
    "sparse_policy": "e.g. 'full', 'quest:token_budget=2048' or 'prefill=xattn;decode=quest' (one policy per phase)",
    "attention_backend": "e.g. 'auto', 'torch'",
}


def engine_fields() -> list[attrs.Attribute]:
    return [f for f in attrs.fields(EngineConfig) if f.name != "model"]


def _flag_type(field: attrs.Attribute):
    kind = str(field.type)
    if kind.startswith("bool"):
        return bool
    if kind.startswith("int"):
        return int
    if kind.startswith("float"):
        return float
    return str


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per engine option. Flags left out keep ``EngineConfig``'s defaults (they are not set
    on the namespace at all)."""
    # a group given (as vLLM scripts pass one) takes the flags itself: argument groups do not nest
    group = (parser if isinstance(parser, argparse._ArgumentGroup)
             else parser.add_argument_group("engine options (as LLM(...) takes them)"))
    for field in engine_fields():
        flag = "--" + field.name.replace("_", "-")
        kind = _flag_type(field)
        help_text = "; ".join(filter(None, [EXAMPLES.get(field.name), f"default: {field.default!r}"]))
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=argparse.SUPPRESS, choices=CHOICES.get(field.name),
                               metavar=None if field.name in CHOICES else kind.__name__.upper(), help=help_text)
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line, as ``LLM(model, **kwargs)`` takes them."""
    return {f.name: getattr(args, f.name) for f in engine_fields() if hasattr(args, f.name)}


def _add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--model`` and one flag per engine option; returns ``parser``. A flag left out is not set on the
    namespace (``parser.set_defaults(model=...)`` gives ``--model`` a default), so ``LLM(**vars(args))``
    gets the options given and keeps the engine's defaults for the rest (``--model`` unset: the built-in
    model)."""
    parser.add_argument("--model", type=str, default=argparse.SUPPRESS,
                        help="a Hugging Face-format directory, a hub ID or a preset; default: the built-in "
                             "SmolLM2-135M-Instruct")
    add_engine_args(parser)
    return parser


def _from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
    """The options on ``args`` (flags left out keep their defaults)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


# vLLM's EngineArgs: a dataclass of every engine option (``LLM(**dataclasses.asdict(engine_args))``), with
# the command-line side. Made from EngineConfig, so the two never disagree.
EngineArgs = dataclasses.make_dataclass(
    "EngineArgs",
    [(f.name, f.type, dataclasses.field(default=f.default)) for f in attrs.fields(EngineConfig)],
    kw_only=True,
    namespace={
        "__doc__": "Every ``LLM`` option as a dataclass field (defaults: ``EngineConfig``'s), with vLLM's "
                   "``add_cli_args(parser)`` and ``from_cli_args(args)``.",
        "__module__": __name__,
        "add_cli_args": staticmethod(_add_cli_args),
        "from_cli_args": classmethod(_from_cli_args),
    },
)
