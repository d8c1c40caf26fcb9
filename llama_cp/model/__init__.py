"""A run's model: the one place it is built (build), its chunked loss (loss), the preference losses on it (preference) and its FLOPs (flops)."""
