"""Context-parallel attention's parts, below the entry in ``llama_cp/cp_attention.py``: the
strategies, one file each (ring, ulysses, allgather, hybrid; local: one process's attention;
choose: which strategy ``auto`` picks; wire: the bytes they send), the local kernels: the backend
choice (kernels), the routing and cutting of soft-capped and windowed calls (windows), how each
backend's kernel is called (kernel_calls), the exact CPU kernel for windows and soft-caps (dense),
what they allocate (workspace), packed documents, windows and their layouts under CP (documents),
and attention over exactly their pieces (pieces)."""
