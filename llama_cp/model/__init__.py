"""A run's model: the one place it is built (build), its chunked loss (loss) and its FLOPs (flops)."""
