"""Does a model use its long context? The passkey / needle grid: retrieval accuracy by length and
depth (needle), loss and perplexity by length and position (perplexity), a saved LoRA adapter
rebuilt on its base and the tokenizer of a saved run (adapter), the heatmap, the loss plot and
the result files (plots), a model named on the command line evaluated end to end (evaluate),
and the trained model's evaluations at the end of a run (trained)."""
