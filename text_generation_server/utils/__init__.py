"""Shard-side utilities: model files on disk and on the hub."""
