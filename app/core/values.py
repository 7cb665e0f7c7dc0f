"""The value types the edge (app/api) needs from the core's collaborators, given a home in the core: the edge speaks
to the core alone and imports neither the store nor the index (tests/unit/test_layers.py)."""

from app.index.records import NamespaceUsage
from app.storage.base import BodyPieces, Version

__all__ = ["BodyPieces", "NamespaceUsage", "Version"]
