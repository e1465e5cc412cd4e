"""``LLM``: the offline entry point, with vLLM's name and arguments."""

from __future__ import annotations

import json
from typing import Any

from nanovllm.chat_utils import ChatOptions
from nanovllm.chat_utils import render as render_chat
from nanovllm.engine.input_processor import Prompt
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.sequence import Sequence
from nanovllm.inputs import TokensPrompt
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

# generation_config.json fields that are sampling defaults, and their SamplingParams names (vLLM's set)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}

# vLLM arguments for features nanovllm does not have: accepted as None, a clear error otherwise
_UNSUPPORTED_ARGUMENTS = {
    "lora_request": "nanovllm has no LoRA support; merge the adapter into the model's weights and load that",
    "mm_processor_kwargs": "nanovllm has no multimodal support: it runs text-only models",
}


def _check_unsupported(**arguments: object) -> None:
    for name, value in arguments.items():
        if value is not None:
            raise ValueError(f"{name}={value!r:.80} is not supported: {_UNSUPPORTED_ARGUMENTS[name]}; leave {name} "
                             "unset (None)")


class LLM:
    """``LLM(model=None, **config)``; ``model`` is a Hugging Face-format directory, a hub ID or a preset, or
    unset for the built-in SmolLM2-135M-Instruct. See :class:`nanovllm.config.EngineConfig` for the options,
    and :class:`~nanovllm.engine.llm_engine.LLMEngine` for ``observers``.

    ``generate`` and ``chat`` run on the engine's step API (``add_request``, ``step``,
    ``has_unfinished_requests``, ``abort_request``), which ``llm.llm_engine`` offers as in vLLM. The engine's
    other attributes (``runner``, ``scheduler``, ``tokenizer``, ``config``, the step API) read through
    ``llm`` too; set them on ``llm.llm_engine``."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(model, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "llm_engine":  # not set yet: the engine failed to start
            raise AttributeError(name)
        return getattr(self.llm_engine, name)

    def get_tokenizer(self):
        """The Hugging Face tokenizer the engine encodes and decodes with."""
        return self.llm_engine.get_tokenizer()

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers (a no-op with one rank). Garbage collection does the same."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """A new ``SamplingParams`` with the sampling defaults of the model's ``generation_config.json``
        (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as
        ``max_tokens``), as vLLM's; ``SamplingParams()`` when the model has none of them."""
        path = self.llm_engine.model_path / "generation_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        defaults = {name: config[key] for key, name in GENERATION_DEFAULTS.items() if config.get(key) is not None}
        try:
            return SamplingParams(**defaults)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the sampling defaults of {str(path)!r}, {defaults}, are not valid SamplingParams: "
                             f"{exc}; fix that file, or build SamplingParams(...) yourself") from exc

    # -- the offline API ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: object = None,
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt; outputs come back in prompt order. ``lora_request`` is
        vLLM's and must stay None: nanovllm runs no LoRA adapters.

        Under ``torchrun`` (``distributed_executor_backend="external_launcher"``) every rank calls this with
        the same arguments: rank 0 runs the call, the others follow its steps, and every rank returns
        rank 0's outputs (or raises when rank 0 did)."""
        _check_unsupported(lora_request=lora_request)
        engine = self.llm_engine
        return engine.world.run_on_every_rank(lambda: self._generate(prompts, sampling_params, use_tqdm),
                                              engine.runner)

    def _generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings, token-id lists or dicts")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or not all(
            isinstance(p, SamplingParams) for p in sampling_params
        ):
            raise TypeError("sampling_params must be SamplingParams or a list of them, one per prompt")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        # Check every prompt before queueing any, so a bad one leaves the engine untouched.
        engine = self.llm_engine
        requests = [engine.input_processor.process(prompt, params, i)
                    for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True))]
        seqs = [engine.enqueue(t, ids, p) for (t, ids), p in zip(requests, sampling_params, strict=True)]
        return self._run(seqs, use_tqdm)

    def _run(self, seqs: list[Sequence], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(seqs), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        engine = self.llm_engine
        scheduler = engine.scheduler
        unfinished = seqs  # requests with a completion still running
        num_finished = scheduler.num_finished
        try:
            with bar:
                while unfinished:
                    if not scheduler.has_unfinished():
                        raise RuntimeError("the scheduler ran dry before every request finished")
                    engine.step()  # outputs are only for add_request(request_id, ...) requests
                    if scheduler.num_finished != num_finished:  # some sequence finished: look which requests
                        num_finished = scheduler.num_finished
                        unfinished = [seq for seq in unfinished if not all(s.is_finished for s in seq.group)]
                        bar.update(len(seqs) - len(unfinished) - bar.n)
        except BaseException:  # e.g. KeyboardInterrupt between steps: drop this call's requests, keep others
            for seq in unfinished:
                for s in seq.group:
                    if not s.is_finished:
                        scheduler.abort(s)
            raise
        return [engine.output_builder.output(seq) for seq in seqs]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: object = None,
        *,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply a chat template (the tokenizer's, or ``chat_template``) to one conversation or a list of
        them, then generate; each output's ``prompt`` is the rendered text. The options are vLLM's:
        ``chat_template_kwargs`` are extra template variables (e.g. Qwen3's ``enable_thinking``),
        ``continue_final_message`` extends the last (assistant) message instead of starting a new one.
        ``lora_request`` and ``mm_processor_kwargs`` must stay None: nanovllm runs no LoRA adapters and no
        multimodal models."""
        _check_unsupported(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
        if not messages or not isinstance(messages, list):
            raise ValueError("messages must be a conversation (list of {'role', 'content'} dicts) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        options = ChatOptions(
            chat_template=chat_template, chat_template_kwargs=chat_template_kwargs or {},
            chat_template_content_format=chat_template_content_format, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
        )
        tokenizer = self.llm_engine.tokenizer
        texts = render_chat(tokenizer, conversations, options)
        # the template writes any special tokens (BOS) itself, so the tokenizer adds none
        prompts = [TokensPrompt(prompt_token_ids=tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
        return outputs
