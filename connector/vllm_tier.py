"""The module path users write for the tier in vLLM's config (``"module_path": "connector.vllm_tier"``): the tier
lives in ``connector/vllm/tier.py``."""

from connector.vllm.tier import KVGateTier as KVGateTier
