"""What to load and store, per step: the scheduler's plan, the cost model (load or recompute) and the P/D hand-off.
vLLM-free and device-free; it asks the gateway through ``connector.http``."""
