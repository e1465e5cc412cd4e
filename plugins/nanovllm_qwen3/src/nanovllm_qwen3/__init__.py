"""nanovllm model-family plugin for Qwen3 (Qwen3ForCausalLM: GQA, q/k RMSNorm, tied or untied embeddings)."""
