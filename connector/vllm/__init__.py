"""The vLLM wing: the only modules that import vLLM (the connector, its layout resolution and metrics, the
OffloadingConnector tier and its hand-off), and the settings vLLM hands them.

``connector.vllm`` is also the ``kv_connector_module_path`` users write in vLLM's config, so the package offers
``KVGateConnector``; it is imported on first use, so that the wing's vLLM-free modules (settings, tier_meta) import
where vLLM is not installed."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from connector.vllm.connector import KVGateConnector

__all__ = ["KVGateConnector"]


def __getattr__(name: str) -> object:
    if name == "KVGateConnector":
        from connector.vllm.connector import KVGateConnector

        return KVGateConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
