"""The core: a key's life (versions), the request operations (service), multi-part objects (parts), upkeep,
capacity, reconcile, reads and events, assembled in one place (assembly)."""
