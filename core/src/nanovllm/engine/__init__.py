"""The engine: sequences, block manager, scheduler, model runner, and LLMEngine tying them together."""
