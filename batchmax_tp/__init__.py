"""batchmax_tp: high-throughput batched LLM inference with KV-cache eviction in prefill and decoding (Batch-Max)."""

__version__ = "0.1.0"
