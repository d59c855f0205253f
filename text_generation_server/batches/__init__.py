"""Batches the engines step: the Batch contract (batch.py), request checks and truncation (inputs.py),
left-padded causal and seq2seq batches over preallocated caches (padded*.py, kv_cache.py), and
ragged batches with prompt chunks (ragged.py).
"""
