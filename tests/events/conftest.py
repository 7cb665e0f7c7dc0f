"""The engine venv and the tiny model of tests/engine, for the engine test of the events (test_engine_events.py)."""

from tests.engine.conftest import engine_python, tiny_model

__all__ = ["engine_python", "tiny_model"]
