"""Compute kernels. Each op has a plain-torch reference here (the CPU path and the test oracle);
GPU implementations (Triton, flash-attn) sit beside it and are checked against it."""
