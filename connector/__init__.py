"""kvgate's vLLM side: the key contract, the canonical layout, transfers and the connector."""
