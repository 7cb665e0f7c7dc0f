"""KVGateOffloadingConnector: vLLM's ``OffloadingConnector``, telling the kvgate tier each new request's tokens.

A secondary tier of vLLM 0.33 sees offload keys and a ``ReqContext``, never the request; the gateway's KV events need
each chunk's token ids and its parent's hash. This connector announces the request (connector/vllm/tier_meta.py) while
vLLM hands it to the tiers, and changes nothing else. Use it in place of ``OffloadingConnector``::

    --kv-transfer-config '{"kv_connector": "KVGateOffloadingConnector",
                           "kv_connector_module_path": "connector.vllm_offloading", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"secondary_tiers": [{"type": "KVGateTier",
                               "module_path": "connector.vllm_tier", "url": "http://127.0.0.1:8750"}], ...}}'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from connector.vllm.tier_meta import RequestTokens, announced

if TYPE_CHECKING:
    from vllm.v1.request import Request


class KVGateOffloadingConnector(OffloadingConnector):  # type: ignore[misc]  # vllm is untyped here
    def on_new_request(self, request: Request) -> None:
        token = announced.set(RequestTokens(tokens=request.all_token_ids, hashes=request.block_hashes))
        try:
            super().on_new_request(request)
        finally:
            announced.reset(token)
