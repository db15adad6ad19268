"""The serving node: the plan, llama-server's supervision, and the API port (proxy, replay, receipts, metrics)."""
