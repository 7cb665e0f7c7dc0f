"""The module path users write for the connector that tells the tier each request's tokens
(``"kv_connector_module_path": "connector.vllm_offloading"``): it lives in ``connector/vllm/offloading.py``."""

from connector.vllm.offloading import KVGateOffloadingConnector as KVGateOffloadingConnector
