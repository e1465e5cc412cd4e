"""nanovllm model-family plugin for Llama (LlamaForCausalLM, including llama3 RoPE scaling; SmolLM2)."""
