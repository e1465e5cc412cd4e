"""nanovllm model-family plugin for Mistral (MistralForCausalLM: a Llama with a sliding window on every
layer)."""
