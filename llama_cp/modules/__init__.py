"""What we know of a HuggingFace causal LM, below the parallel wrappers: loading and building it
(causal_lm), its family's attention features (families), QLoRA's 4-bit linears (quantize),
tiled MLPs and norms (tiling), and activation checkpoints kept in host memory (offload)."""
