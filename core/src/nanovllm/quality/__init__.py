"""Attention quality of sparse policies: how much of dense attention a block selection keeps.

- :mod:`~nanovllm.quality.planted`: attention inputs with planted structure and known ground truth,
  for unit tests of selectors.
- :mod:`~nanovllm.quality.metrics`: mass recall, top-k recall, output error and density of a selection,
  next to the oracle selection and a random one with as many blocks.
- :mod:`~nanovllm.quality.corpus`: a long English text found on the machine (never downloaded).
- :mod:`~nanovllm.quality.capture`: queries, keys and values of chosen layers while the engine runs.
- :mod:`~nanovllm.quality.evaluate`: a policy called as the engine calls it, on captured activations.
- :mod:`~nanovllm.quality.passkey`: pass-key retrieval prompts, exact in tokens, and their scoring.
- :mod:`~nanovllm.quality.long_context`: pass key, perplexity against context length and attention
  metrics of the full-attention layers, per selection next to dense and transformers
  (``benchmarks/long_context_quality.py``).

``nanovllm bench quality`` (:mod:`nanovllm.bench.quality`) puts them together on the built-in model.
"""
