"""Running a job: the training loop (trainer) and the objective it plugs in (objective: the
protocol; sft, preference), its output directory (run_dir), checkpoints (checkpoint; their files,
manifest and verification: checkpoint_files; a write that fails on any rank: write_failures),
resuming from one (resume), the trained model written out (export), signals, non-finite losses
and failed collectives (failures), metrics and peak memory (reporting), DPO's reference
log-probabilities computed once (reference), the command line (cli) and local multi-process
launch (launcher)."""
