"""nanovllm model-family plugin for Gemma 3, text only (Gemma3ForCausalLM: sliding-window and global
layers, per-layer RoPE, q/k norms, sandwich norms, GELU-tanh MLP)."""
