"""What the tests and the benchmarks both run against, on this machine: servers on loopback ports (a gateway process,
S3-compatible servers (moto, SeaweedFS), PostgreSQL, a throttling TCP proxy, certificates and an HTTPS gateway), the
engine's tiny random model, and a vLLM secondary tier driven on its own. No product code: not in the wheel,
imported by tests/ and benchmarks/ alike, and importing neither."""
