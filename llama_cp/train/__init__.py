"""Running a job: the training loop (trainer), its output directory (run_dir), checkpoints
(checkpoint), resuming from one (resume), the trained model written out (export), signals,
non-finite losses and failed collectives (failures), metrics and peak memory (reporting), DPO's reference log-probabilities computed once (reference), the command line
(cli) and local multi-process launch (launcher)."""
