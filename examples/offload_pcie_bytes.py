"""Count the KV bytes that cross PCIe per layer under KV offload: an observer of the offload hooks.

With ``kv_offloading_size`` the KV of the offloaded layers lives in a pinned host pool; each step the
engine stores the new keys and values to the pool and loads the blocks attention reads into GPU slots.
``on_prefill_offload`` and ``on_decode_offload`` report each of those transfers (a
:class:`nanovllm.kv.KVTransfer`: the layer, the phase, ``kind`` "store" or "load", and the bytes moved).
They are notifications: a policy stays correct without them. Pass an observer to ``LLM(observers=[...])``.
Only the pool's layers move KV: the layers a policy runs dense stay on the GPU, and so do a hybrid model's
sliding-window layers (Gemma 3's), which keep only their windows there, so their rows never appear.

Run it (the built-in model unless ``--model`` names another; ``--device cpu`` runs the same offload path
with host copies)::

    python examples/offload_pcie_bytes.py --device cpu
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from nanovllm import LLM, SamplingParams
from nanovllm.sparse import KVTransfer


class PCIeBytes:
    """Bytes the host store moved, per layer: ``stored[layer]`` from the GPU to the pool, ``loaded[layer]``
    from the pool into GPU slots, over every step since it was made or last cleared. Reading a transfer's
    size waits for the GPU, so an engine with this observer decodes eagerly (it does not declare
    ``cuda_graph_safe``)."""

    def __init__(self) -> None:
        self.stored: defaultdict[int, int] = defaultdict(int)
        self.loaded: defaultdict[int, int] = defaultdict(int)

    def clear(self) -> None:
        self.stored.clear()
        self.loaded.clear()

    def on_prefill_offload(self, transfer: KVTransfer) -> None:
        self._count(transfer)

    def on_decode_offload(self, transfer: KVTransfer) -> None:
        self._count(transfer)

    def _count(self, transfer: KVTransfer) -> None:
        table = self.stored if transfer.kind == "store" else self.loaded
        table[transfer.layer_id] += transfer.num_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or hub name (default: the built-in model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--kv-offloading-size", type=float, default=0.25, help="host pool, GiB")
    args = parser.parse_args()
    counter = PCIeBytes()
    llm = LLM(args.model, device=args.device, kv_offloading_size=args.kv_offloading_size, max_model_len=1024,
              observers=[counter])
    counter.clear()  # what the engine's start-up moved (its warm-up on a GPU) is not the prompts'
    prompt = "The history of the printing press, in a few paragraphs: " * 8
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    print(f"{'layer':>5} {'stored MiB':>11} {'loaded MiB':>11}")
    for layer in sorted(counter.stored.keys() | counter.loaded.keys()):
        print(f"{layer:>5} {counter.stored[layer] / 2**20:>11.3f} {counter.loaded[layer] / 2**20:>11.3f}")
    print(f"{'all':>5} {sum(counter.stored.values()) / 2**20:>11.3f} {sum(counter.loaded.values()) / 2**20:>11.3f}")


if __name__ == "__main__":
    main()
