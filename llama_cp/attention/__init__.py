"""Context-parallel attention's parts, below the entry in ``llama_cp/cp_attention.py``: the local
kernels and their backends (kernels, dense), what they allocate (workspace), and packed
documents, windows and their layouts under CP (documents)."""
