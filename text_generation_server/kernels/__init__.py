"""GPU kernels (Triton), reached only through an attention backend (text_generation_server/attention/):
no engine or model calls them directly. Each module owns one kernel family, imports without Triton
installed, and says through `available()` whether it can run here.
"""
