"""Router process: external gRPC API, validation, queue, continuous batching, streaming (torch-free)."""
