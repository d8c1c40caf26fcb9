"""The flags whose default depends on the run: a TrainConfig's auto values resolved from its model
and dataset (Note [Defaults by run]). ``TrainConfig.resolve_defaults`` and its kin call these."""

from __future__ import annotations

from llama_cp.data.grammar import PASSKEY
from llama_cp.flags.checks import memory_levers_given

# Note [Defaults by run]
# ~~~~~~~~~~~~~~~~~~~~~~~
# The embedded model is a small Llama with random weights that the passkey demo trains from
# scratch on a CPU in minutes: it wants a large learning rate (1e-3), a fixed number of steps
# (200; an epoch of its 512 generated rows is another schedule) and nothing saved on the way.
# A real checkpoint wants the opposite: a learning rate that does not wreck pretrained weights
# (2e-5 for every weight, TRL's SFT default; 2e-4 for LoRA adapters, as peft's guides use),
# whole epochs of the user's data unless --max_steps says otherwise (transformers' Trainer and
# TRL), activation checkpointing (without it an 8B model's activations at 128K tokens do not
# fit any GPU; it is exact, and costs a recompute of each layer's forward), and checkpoints
# during the run so a failure hours in loses little. The flags that differ keep an "auto"
# value (lr 0, max_steps -1, save_every -1, activation_checkpointing None), resolved here, at
# start, from the model and the dataset; the resolved values are what config.yaml and
# run_info.json record, and a flag given explicitly always wins. --save_every is resolved by
# the trainer once the run's steps are known (resolved_save_every). --memory default is resolved
# first, to auto when no memory lever is given and manual otherwise, while an
# --activation_checkpointing left to auto is still None; on CUDA --memory auto then replaces the
# levers by its choice before the model is built (Note [Choosing the memory levers] in
# llama_cp/plan/auto.py), and the resolved checkpointing above is what a run it cannot plan keeps.


def is_demo(cfg) -> bool:
    """The embedded passkey demo: --model_name and --dataset left at their defaults."""
    return cfg.model.model_name == "embedded" and cfg.data.dataset == PASSKEY


def resolve_defaults(cfg) -> None:
    """Replace the auto values of --memory, --lr, --activation_checkpointing and --max_steps by this
    run's (Note [Defaults by run]); idempotent."""
    embedded = cfg.model.model_name == "embedded"
    if cfg.model.memory == "default":  # first, while an --activation_checkpointing left to auto still shows
        cfg.model.memory = "manual" if memory_levers_given(cfg.model) else "auto"
    if cfg.optim.lr == 0 and cfg.objective == "dpo":  # a preference loss moves a tuned model: smaller steps
        cfg.optim.lr = 1e-3 if embedded else 5e-6 if cfg.peft.use_peft else 1e-6
    if cfg.optim.lr == 0:
        cfg.optim.lr = 1e-3 if embedded else 2e-4 if cfg.peft.use_peft else 2e-5
    if cfg.model.activation_checkpointing is None:
        cfg.model.activation_checkpointing = not embedded
    if cfg.max_steps == -1:
        cfg.max_steps = 200 if is_demo(cfg) else 0


def resolved_save_every(cfg, total_steps: int) -> int:
    """--save_every, auto resolved for a run of ``total_steps`` steps (Note [Defaults by run]):
    only at the end for the demo, else every tenth of the run, at most 500 steps apart."""
    if cfg.save_every != -1:
        return cfg.save_every
    return 0 if is_demo(cfg) else max(1, min(500, -(-total_steps // 10)))


def said_defaults(cfg, total_steps: int) -> str:
    """The start line of a run that is not the demo: what its steps, --lr, checkpointing and
    checkpoints resolved to (after ``resolved_save_every``), and a warm-up the run never leaves."""
    length = f"--max_steps {cfg.max_steps}" if cfg.max_steps else f"--num_epochs {cfg.num_epochs}"
    saves = "at the end" if not cfg.save_every else "every step" if cfg.save_every == 1 else \
        f"every {cfg.save_every} steps"
    warm = cfg.optim.warmup_steps
    unreached = f" (not reached: --warmup_steps {warm} is longer than the run)" if warm >= total_steps else ""
    return (f"{total_steps} steps ({length}), --lr {cfg.optim.lr:g}{unreached}, activation checkpointing "
            f"{'on' if cfg.model.activation_checkpointing else 'off'}, checkpoints {saves} "
            "(Note [Defaults by run] in llama_cp/flags/defaults.py)")


def passkey_key_digits(cfg) -> int:
    """--passkey_digits, auto resolved: 1 for the embedded model, else 5 (Note [Passkey length warm-up])."""
    if cfg.data.passkey_digits:
        return cfg.data.passkey_digits
    return 1 if cfg.model.model_name == "embedded" else 5
