"""kvgate's vLLM side, by wing: ``connector.http`` (the gateway's client: its two transports, budget, stats,
errors), ``connector.planning`` (what to load or store, and whether a load beats recompute), ``connector.device``
(the canonical layout, pinned buffers, CUDA streams, gather and scatter), ``connector.worker`` (a worker's stores
and loads per step, on device copies and the client) and ``connector.vllm`` (the only modules that import vLLM,
and the settings vLLM hands them).

The module paths users write in vLLM's config stay where the docs give them: ``connector.vllm`` (KVGateConnector),
``connector.vllm_tier`` (KVGateTier) and ``connector.vllm_offloading`` (KVGateOffloadingConnector)."""
