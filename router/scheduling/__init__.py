"""The continuous-batching loop, its queue and the shard client: what runs the model calls. Imports
router.core only.
"""
