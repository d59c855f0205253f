"""Logits processing, token choice and token details, vectorised over heterogeneous batches."""
