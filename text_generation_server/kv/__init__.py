"""KV memory of the paged engine: the block pool, block tables and their one owner (paged_kv.py)."""
