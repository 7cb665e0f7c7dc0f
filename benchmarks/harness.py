"""What the benchmarks share that is neither a server (those are in loopback/, with the tests) nor a measurement:
the namespace their blocks go in and the block paths they write.

A benchmark's blocks are those of one made-up run (a parallel-agnostic run, one full-attention group of 16-token
blocks), so every script writes valid paths the gateway accepts, in a namespace of the benchmarks' own."""

from __future__ import annotations

import hashlib

from contract.keys import block_path, namespace_for, run_fields

NAMESPACE = namespace_for(
    run_fields(
        model_name="bench-org/bench-model",
        tokens_per_hash=16,
        blocks_per_file=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        dtype="bfloat16",
        kv_cache_groups=[{"tokens_per_block": 16, "layer_names": ["layer.0"]}],
        parallel_agnostic=True,
    )
)
"""The namespace every benchmark's blocks go in."""


def key_for(i: int, *, rank: int = 0) -> str:
    """The block path numbered ``i`` in :data:`NAMESPACE` (its hash: sha256 of ``i``), the same for every run."""
    digest = hashlib.sha256(str(i).encode()).digest()
    return block_path(namespace=NAMESPACE, rank=rank, block_hash=digest, group=0)
