"""Part 4 of the GPU acceptance run: the longest context whose step runs at cp = N."""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.gpu.settings import Settings
from benchmarks.gpu.step import training_step


def longest_job() -> dict:
    """Part 4's job; its ``tried`` fills in as lengths are decided (``run_jobs`` goes on from them)."""
    return {"id": "longest", "kind": "longest", "args": {"tried": {}}}


def longest_context(s: Settings, tried: dict[int, bool], note) -> dict[str, Any]:
    """The largest context whose step runs at cp = N (activation checkpointing): doubling from
    ``s.start_len`` until one does not, then bisecting down to 1/16 of the length. ``tried``:
    lengths already decided (a group that ran out of memory ended on the last one); ``note``
    records each decision before and after a step, so a fresh group goes on from there."""
    cp, unit = s.nproc, 2 * s.nproc

    def runs(length: int) -> bool:
        if length not in tried:
            if s.fits is not None and length > s.fits:  # --dry_run: over its limit, not run
                tried[length] = False
            else:
                note({"trying": length})
                training_step(dataclasses.replace(s, steps=2), context_length=length, cp=cp,
                              flags={"activation_checkpointing": True})
                tried[length] = True
            note({"tried": length, "runs": tried[length]})
        return tried[length]

    good, bad = 0, s.start_len
    while runs(bad):
        good, bad = bad, 2 * bad
    while good and bad - good > max(unit, good // 16):
        middle = (good + bad) // 2 // unit * unit
        good, bad = (middle, bad) if runs(middle) else (good, middle)
    return {"cp": cp, "longest_context": good, "first_failing": bad,
            "tried": {str(k): v for k, v in sorted(tried.items())}}
