"""The parts of the GPU acceptance run (``benchmarks/gpu_acceptance.py``), importable on their own so
that other GPU reports can reuse them."""
