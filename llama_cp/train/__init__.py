"""Running a job: the training loop (trainer), its output directory (run_dir), checkpoints
(checkpoint), metrics (reporting), the command line (cli) and local multi-process launch (launcher)."""
