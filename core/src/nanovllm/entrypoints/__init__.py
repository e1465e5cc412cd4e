"""Ways to run the engine other than the offline ``LLM``: the OpenAI-compatible server."""
