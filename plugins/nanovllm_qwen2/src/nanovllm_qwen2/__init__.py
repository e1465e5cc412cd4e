"""nanovllm model-family plugin for Qwen2 (Qwen2ForCausalLM: q/k/v biases, optional sliding-window layers)."""
