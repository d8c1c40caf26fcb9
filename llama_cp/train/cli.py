"""What the command-line recipes share: ``--help``, and errors as one paragraph, printed once.

    if __name__ == "__main__":
        run_cli(main, usage="python -m recipes.finetune_longctx [--config preset.yaml] [--flag value ...]")

``--help`` / ``-h`` print ``main``'s docstring and every training flag with its
default and doc (``TrainConfig.help``); a command whose flags are not the training
flags passes ``flags`` (one line of doc per parameter of ``main``) and ``--help``
lists those instead, with the defaults of ``main``'s signature, and a flag ``main``
does not take is refused in one line before it runs (fire would run it and
complain after). An exception ends the command with exit
status 1 and one line, ``error: <message>``, instead of a traceback; ``--debug``
shows the traceback. Mistakes in the input (``ValueError``, ``FileNotFoundError``,
``KeyError``) and deliberate stops (``TrainingStopped``) happen on every rank
alike, so only rank 0 prints them, and the other ranks wait until it has (at most
a few seconds) before they exit, so that the launcher does not end rank 0 before its
line is out (Note [An error on every rank]); anything else is printed by each rank it
happens on, with the rank. A rank that gave up on a stuck collective then ends the job's other ranks
on its machine and itself at once (Note [Stuck ranks] in ``llama_cp/train/failures.py``).
"""

from __future__ import annotations

import difflib
import inspect
import os
import sys
import time
from collections.abc import Callable, Mapping

import fire

from llama_cp.config import TrainConfig

#: Exceptions that come from the command's input and happen on every rank alike.
INPUT_ERRORS = (ValueError, FileNotFoundError, KeyError, PermissionError)
#: Seconds a rank other than 0 waits before it exits on an error of every rank (Note [An error on every rank]).
QUIET_RANK_GRACE_S = 10.0

# Note [An error on every rank]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A mistake in the input (a missing --dataset, a bad flag) fails every rank alike, and
# only rank 0 says so. But torchrun's agent ends every other worker (SIGTERM) as soon as
# one worker exits with a failure: when rank 1 raised first and exited at once, the agent
# killed rank 0 before it printed, and the user saw torchrun's report and no error line
# (CI, 2026-11-28: rank 0 ended by SIGTERM, no error line printed). So a rank other
# than 0 that holds such an error waits, at most QUIET_RANK_GRACE_S, before it exits:
#
# - with the process group up (a stop signal's TrainingStopped, a failed write), until
#   rank 0 has printed: rank 0 then sets ERROR_SAID_KEY in the group's store (the
#   TCPStore torchrun's rendezvous made; ``_get_default_store`` in
#   torch/distributed/distributed_c10d.py, read in torch 2.10 and 2.13) and the others,
#   waiting on it, exit at once. A stop by SIGTERM to torchrun itself (SLURM, k8s) must
#   not wait: that agent signals its workers once and then only waits for them, inside
#   its 30 s shutdown timeout and the scheduler's grace period;
# - before the group exists (the flags, the files: most input errors), for the whole
#   QUIET_RANK_GRACE_S: rank 0 prints and exits meanwhile, and the agent ends the
#   waiting rank (SIGTERM ends the sleep: the trainer's stop-signal handler is restored
#   before an error reaches run_cli). Under a launcher that does not end the job on the
#   first failure (srun without --kill-on-bad-exit), the job ends those seconds later.
#
# An input error of one rank only (a path that exists on one node) is still said by nobody;
# rank 0 then fails at its next collective (Note [Stuck ranks] in llama_cp/train/failures.py).
#: The store key rank 0 sets once it has printed an error of every rank.
ERROR_SAID_KEY = "llama_cp/error_said"


def _group_store():
    """The default process group's store, or None when there is no group (or no store to reach)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the quiet rank sleeps instead
        return None


def _wait_for_rank_0() -> None:
    """A quiet rank's wait before it exits on an error of every rank (Note [An error on every rank])."""
    from datetime import timedelta

    store = _group_store()
    if store is None:
        time.sleep(QUIET_RANK_GRACE_S)
        return
    try:
        store.wait([ERROR_SAID_KEY], timedelta(seconds=QUIET_RANK_GRACE_S))
    except Exception:  # noqa: BLE001 - rank 0 said nothing in time: exit all the same
        pass


def _say_said() -> None:
    """Rank 0, after printing an error of every rank: let the waiting ranks go."""
    store = _group_store()
    if store is not None:
        try:
            store.set(ERROR_SAID_KEY, "1")
        except Exception:  # noqa: BLE001 - the others then wait out QUIET_RANK_GRACE_S
            pass


def run_cli(
    main: Callable, usage: str, argv: list[str] | None = None, defaults: dict | None = None,
    flags: Mapping[str, str] | None = None,
) -> None:
    """Run ``main`` with fire on ``argv`` (default ``sys.argv[1:]``); see the module docstring.
    ``defaults``: the command's own defaults of training flags, which ``--help`` shows.
    ``flags``: the command's own flags instead of the training flags, ``{parameter of main:
    one-line doc}``: ``--help`` lists them, and an unknown one is refused before ``main`` runs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        doc = inspect.getdoc(sys.modules[main.__module__]) or inspect.getdoc(main) or ""
        listed = TrainConfig.help(defaults) if flags is None else command_help(main, flags)
        print(f"usage: {usage}\n\n{doc}\n\n{listed}")
        return
    debug = "--debug" in argv
    argv = [arg for arg in argv if arg != "--debug"]
    try:
        if flags is not None:
            check_flags(main, argv)
        fire.Fire(main, command=argv)
    except Exception as error:  # noqa: BLE001 - every failure ends here, as one paragraph
        if debug:
            raise
        close_progress_bars()
        rank = int(os.environ.get("RANK", "0"))
        input_error = isinstance(error, INPUT_ERRORS) or getattr(error, "same_on_every_rank", False)
        if rank == 0 or not input_error:
            many = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not input_error
            prefix = f"error (rank {rank})" if many else "error"
            said = [str(error), *getattr(error, "__notes__", [])]  # notes: what a caller added (add_note)
            message = " ".join("; ".join(part for part in said if part).split()) or type(error).__name__
            print(f"{prefix}: {message} (rerun with --debug for the traceback)", file=sys.stderr, flush=True)
            if input_error:
                _say_said()
        else:  # rank 0 says it: give it the time to (Note [An error on every rank])
            _wait_for_rank_0()
        if callable(getattr(error, "end_job", None)):  # a stuck rank: end the whole job now (failures.CollectiveFailed)
            error.end_job()
        sys.exit(1)


def close_progress_bars() -> None:
    """Close the tqdm bars a failure left open: a bar on the terminal ends its line only when it
    closes, so the error line would be printed at the end of its last refresh."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def _parameters(main: Callable) -> dict[str, inspect.Parameter]:
    """``main``'s parameters that a ``--name value`` flag can set."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name: p for name, p in inspect.signature(main).parameters.items() if p.kind in kinds}


def command_help(main: Callable, flags: Mapping[str, str]) -> str:
    """The ``--help`` list of a command's own flags: each parameter of ``main`` with its default
    and its line in ``flags`` (KeyError for a parameter without one)."""
    lines = ["flags:"]
    for name, parameter in _parameters(main).items():
        default = parameter.default
        if default is inspect.Parameter.empty:
            shown = "required"
        elif isinstance(default, (tuple, list)):
            shown = "default " + ",".join(f"{value:g}" if isinstance(value, float) else str(value) for value in default)
        else:
            shown = f"default {'none' if default is None else default}"
        lines.append(f"  --{name} ({shown}): {flags[name]}")
    return "\n".join(lines)


def check_flags(main: Callable, argv: list[str]) -> None:
    """ValueError naming the first ``--flag`` of ``argv`` that ``main`` does not take, with the close
    matches (as ``TrainConfig.from_flags`` does for the training flags). fire's own spellings
    pass: ``--flag=value``, ``--flag-name``, ``--noflag`` for a false boolean; a bare ``--`` ends
    the flags."""
    names = list(_parameters(main))
    for arg in argv:
        if arg == "--":
            return
        if not arg.startswith("--"):
            continue
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        if name in names or (name.startswith("no") and name[2:] in names):
            continue
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
        raise ValueError(f"unknown flag --{name}{hint} (run with --help for the list)")
