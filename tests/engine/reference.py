"""HF transformers' K and V for a prompt, in kvgate's canonical block order. Runs in the engine venv.

    python reference.py MODEL_DIR TOKEN_IDS.json BLOCK_SIZE OUT.npy

OUT holds float32 ``(n_blocks, kv_head, layer, k|v, token, head_dim)``: the full blocks of the prompt, built from
``past_key_values`` (K after rotary embedding, as an engine caches it), independently of vLLM and kvgate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model_dir, ids_path, block_size, out = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ids = json.loads(ids_path.read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    layers = []
    for layer in range(model.config.num_hidden_layers):
        k, v = cache.layers[layer].keys, cache.layers[layer].values  # (1, kv_heads, tokens, head_dim)
        layers.append(torch.stack([k[0], v[0]], dim=1))  # (kv_heads, 2, tokens, head_dim)
    kv = torch.stack(layers, dim=1)  # (kv_heads, layer, 2, tokens, head_dim)
    n = len(ids) // block_size
    heads, nl, _, _, d = kv.shape
    blocks = kv[:, :, :, : n * block_size].reshape(heads, nl, 2, n, block_size, d).permute(3, 0, 1, 2, 4, 5)
    np.save(out, blocks.contiguous().numpy())


if __name__ == "__main__":
    main()
