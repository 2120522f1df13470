"""Native kernels (optional, JIT-built) behind small Python entry points."""
