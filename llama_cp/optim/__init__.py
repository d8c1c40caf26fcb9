"""One optimizer step: forward/backward with the global token count, clipping and the update
(step), the optimizers themselves (optimizers), and the learning-rate schedule (schedule)."""
