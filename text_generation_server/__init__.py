"""Model-shard process: engines, batches with their KV caches, sampling (`text-generation-server`)."""
