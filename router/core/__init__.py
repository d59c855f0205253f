"""A request's life in the router, whatever door it came through: validation (TGIS's order and
messages), tokenization, the capacity a request weighs, incremental detokenization, stopping, its
outputs, and the metrics they feed. Imports nothing else of the router.
"""
