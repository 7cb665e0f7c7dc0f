"""kvgate: a KV-cache block gateway for LLM inference."""

__version__ = "0.1.0"
