"""Running a job: the training loop (trainer), its output directory (run_dir), checkpoints and
exports (checkpoint), resuming from one (resume), signals, non-finite losses and failed
collectives (failures), metrics (reporting), the command line (cli) and local multi-process
launch (launcher)."""
