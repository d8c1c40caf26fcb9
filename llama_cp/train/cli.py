"""What the command-line recipes share: ``--help``, and errors as one paragraph, printed once.

    if __name__ == "__main__":
        run_cli(main, usage="python -m recipes.finetune_longctx [--config preset.yaml] [--flag value ...]")

``--help`` / ``-h`` print ``main``'s docstring and every training flag with its
default and doc (``TrainConfig.help``). An exception ends the command with exit
status 1 and one line, ``error: <message>``, instead of a traceback; ``--debug``
shows the traceback. Mistakes in the input (``ValueError``, ``FileNotFoundError``,
``KeyError``) and deliberate stops (``TrainingStopped``) happen on every rank
alike, so only rank 0 prints them; anything else is printed by each rank it
happens on, with the rank. A rank that gave up on a stuck collective then ends the
job's other ranks on its machine and itself at once (Note [Stuck ranks] in
``llama_cp/train/failures.py``).
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable

import fire

from llama_cp.config import TrainConfig

#: Exceptions that come from the command's input and happen on every rank alike.
INPUT_ERRORS = (ValueError, FileNotFoundError, KeyError, PermissionError)


def run_cli(main: Callable, usage: str, argv: list[str] | None = None, defaults: dict | None = None) -> None:
    """Run ``main`` with fire on ``argv`` (default ``sys.argv[1:]``); see the module docstring.
    ``defaults``: the command's own defaults of training flags, which ``--help`` shows."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        doc = inspect.getdoc(sys.modules[main.__module__]) or inspect.getdoc(main) or ""
        print(f"usage: {usage}\n\n{doc}\n\n{TrainConfig.help(defaults)}")
        return
    debug = "--debug" in argv
    argv = [arg for arg in argv if arg != "--debug"]
    try:
        fire.Fire(main, command=argv)
    except Exception as error:  # noqa: BLE001 - every failure ends here, as one paragraph
        if debug:
            raise
        rank = int(os.environ.get("RANK", "0"))
        input_error = isinstance(error, INPUT_ERRORS) or getattr(error, "same_on_every_rank", False)
        if rank == 0 or not input_error:
            many = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not input_error
            prefix = f"error (rank {rank})" if many else "error"
            message = " ".join(str(error).split()) or type(error).__name__
            print(f"{prefix}: {message} (rerun with --debug for the traceback)", file=sys.stderr, flush=True)
        if callable(getattr(error, "end_job", None)):  # a stuck rank: end the whole job now (failures.CollectiveFailed)
            error.end_job()
        sys.exit(1)
