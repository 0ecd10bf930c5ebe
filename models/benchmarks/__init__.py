"""Benchmarks a user runs as ``jaxkv bench`` (vLLM: ``vllm/benchmarks/``): ``throughput`` (offline, ShareGPT,
continuous batching against static batching and transformers) and ``serving`` (a running server under load
through the official ``openai`` client)."""
