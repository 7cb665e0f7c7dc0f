"""The service layer: BlockService and its policies (removal, capacity, reconcile, parts, reads, events)."""
