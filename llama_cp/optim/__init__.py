"""One optimizer step: forward/backward with the global token count, clipping and the update
(step), and the optimizers themselves (optimizers)."""
