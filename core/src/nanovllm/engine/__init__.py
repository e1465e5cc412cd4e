"""The engine. ``LLMEngine`` (the step API) ties the tokenizer, the scheduler and the model runner together;
its start-up runs named steps, each in a module of its own: ``model_loading`` (the model, its tokenizer and
config, the plugin selections, building the model and binding its attention), ``tp_world`` (the
tensor-parallel ranks), ``kv_allocation`` (the KV store), ``cuda_graphs`` (decode graphs). Each step the
runner plans on the host (``step_plan``), runs the model, and samples (``sampling_inputs``)."""
