"""Conversations to prompt text through a Hugging Face chat template, with vLLM's ``chat()`` options.

Messages may carry OpenAI-style content lists (``[{"type": "text", "text": ...}]``); nanovllm runs text-only
models, so any other part type is an error. Templates see the content as one string (the text parts joined
by newlines) or as the list of text parts, whichever the template expects (``chat_template_content_format``).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import attrs

CONTENT_FORMATS = ("auto", "string", "openai")
# chat() arguments of their own: passing them through chat_template_kwargs would be ambiguous
_CHAT_ARGUMENTS = {"add_generation_prompt", "continue_final_message", "tools", "chat_template"}
# apply_chat_template's own parameters, which are no template variables
_RENDER_PARAMETERS = {
    "conversation", "documents", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
}
# a template that loops over a message's content expects OpenAI-style lists of parts
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+\s*(\[\s*['\"]content['\"]\s*\]|\.content)")


@attrs.define(kw_only=True)
class ChatOptions:
    """The options of ``LLM.chat`` that shape the prompt, checked once before any conversation is rendered."""

    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    chat_template_content_format: str = "auto"
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None

    def __attrs_post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "continue_final_message=True continues the last message, so it cannot go with "
                "add_generation_prompt=True (the default): pass add_generation_prompt=False"
            )
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {', '.join(map(repr, CONTENT_FORMATS))}, "
                f"got {self.chat_template_content_format!r}"
            )
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {self.chat_template_kwargs!r}")
        for key in self.chat_template_kwargs:
            if key in _CHAT_ARGUMENTS:
                raise ValueError(f"chat_template_kwargs has {key!r}; pass it as chat()'s own argument {key}=")
            if key in _RENDER_PARAMETERS:
                raise ValueError(f"chat_template_kwargs has {key!r}, which is no template variable; leave it out")
        if self.tools is not None and not (
            isinstance(self.tools, list) and all(isinstance(t, dict) for t in self.tools)
        ):
            raise ValueError(f"tools must be a list of OpenAI-style tool dicts, got {self.tools!r:.80}")
        if self.chat_template is not None:
            self.chat_template = load_chat_template(self.chat_template)


def load_chat_template(value: str) -> str:
    """A Jinja template given as text, or the path of a file holding one."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"chat_template must be a Jinja template or the path of a file with one, got {value!r:.80}")
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(
            f"chat_template {value!r:.80} is neither a Jinja template (no '{{{{' or '{{%' in it) nor a file"
        )
    return path.read_text()


def template_source(tokenizer: Any, options: ChatOptions) -> str | None:
    """The template ``render`` uses: ``chat_template=``, else the tokenizer's (its tool-use variant with tools)."""
    if options.chat_template is not None:
        return options.chat_template
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        name = "tool_use" if options.tools and "tool_use" in template else "default"
        return template.get(name)
    return template


def check_template_kwargs(template: str, options: ChatOptions) -> None:
    """Warn about chat_template_kwargs the template never reads: they would change nothing."""
    import jinja2
    from jinja2 import meta

    if not options.chat_template_kwargs:
        return
    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:  # e.g. a tag of a transformers extension: the render reports real errors
        return
    unused = sorted(set(options.chat_template_kwargs) - meta.find_undeclared_variables(parsed))
    if unused:
        warnings.warn(
            f"the chat template does not use chat_template_kwargs {', '.join(map(repr, unused))}; they change nothing",
            stacklevel=3,
        )


def normalize_conversation(conversation: Any, index: int, content_format: str) -> list[dict[str, Any]]:
    """Check one conversation and give each message's content in ``content_format`` ("string" or "openai")."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError(f"conversation {index} must be a non-empty list of {{'role', 'content'}} dicts")
    messages = []
    for j, message in enumerate(conversation):
        where = f"conversation {index}, message {j}"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where} must be a {{'role', 'content'}} dict with a string role, got {message!r:.80}")
        content = message.get("content")
        if content is None:
            if message["role"] == "assistant" and message.get("tool_calls"):
                messages.append(dict(message))
                continue
            raise ValueError(f"{where} has no 'content' (only an assistant message with 'tool_calls' may omit it)")
        texts = _content_texts(content, where)
        if content_format == "string":
            content = texts if isinstance(content, str) else "\n".join(texts)
        else:
            content = [{"type": "text", "text": t} for t in ([texts] if isinstance(content, str) else texts)]
        messages.append({**message, "content": content})
    return messages


def _content_texts(content: Any, where: str) -> str | list[str]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of content parts, got {content!r:.80}")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            shown = repr(kind) if kind is not None else f"{part!r:.60}"
            raise ValueError(
                f"{where}: content part {k} is {shown}; nanovllm runs text-only models, so only "
                "{'type': 'text', 'text': ...} parts are accepted"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: content part {k} needs a string 'text'")
        texts.append(part["text"])
    return texts


def render(tokenizer: Any, conversations: list[Any], options: ChatOptions) -> list[str]:
    """The prompt text of each conversation. Every conversation is checked and rendered before any is run."""
    template = template_source(tokenizer, options)
    if template is None:
        raise ValueError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; use generate(), "
            "or pass chat_template= (a Jinja template, or the path of a file with one)"
        )
    check_template_kwargs(template, options)
    content_format = options.chat_template_content_format
    if content_format == "auto":
        content_format = "openai" if _LOOPS_OVER_CONTENT.search(template) else "string"

    def apply(messages: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(
            messages, tools=options.tools, chat_template=template, tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **options.chat_template_kwargs,
        )

    texts = []
    for i, conversation in enumerate(conversations):
        messages = normalize_conversation(conversation, i, content_format)
        try:
            texts.append(apply(messages))
        except Exception as exc:  # the template's own checks (e.g. roles must alternate) and Jinja errors
            if content_format == "openai" and _renders(apply, normalize_conversation(conversation, i, "string")):
                raise ValueError(
                    f"conversation {i}: the chat template reads each message's content as a string, but "
                    "chat_template_content_format='openai' passes it as a list of {'type': 'text', 'text': ...} "
                    "parts; pass 'string' (the parts joined by newlines) or 'auto' (the format the template reads)"
                ) from exc
            raise ValueError(f"conversation {i}: the chat template failed: {exc}") from exc
    return texts


def _renders(apply: Any, messages: list[dict[str, Any]]) -> bool:
    try:
        apply(messages)
    except Exception:
        return False
    return True
