"""Our kernels and the CPU linear layouts, below every engine:
- cpu_kernels.py + csrc/: the C++ CPU kernels (paged decode attention, the decoder stack, LoRA,
  the products of 4-bit and 8-bit weights in groups); cpu_build.py: their library per CPU family,
  prebuilt ahead of time or built at first use;
- weight_layout.py: each CPU Linear's weight layout (oneDNN packed or plain), chosen by measurement;
- paged_decode_triton.py: the GPU paged-decode kernel (Triton), reached only through an attention
  backend (text_generation_server/attention/); it imports without Triton installed and says
  through `available()` whether it can run here.
"""
