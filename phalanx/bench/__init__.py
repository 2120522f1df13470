"""Benchmarks: a load generator for any OpenAI-compatible server and in-process offline benchmarks.

Owns: `phalanx bench serve | latency | throughput` (``cli``), the streaming HTTP client and its
per-request timing (``serve``), prompt sources (``datasets``), the metric math and the Prometheus
text parser (``metrics``), and the offline benchmarks through `LLM` (``offline``).
Does not own: the server or the engine; nothing here is imported on the serving path.
"""
