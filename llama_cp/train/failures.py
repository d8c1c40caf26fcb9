"""How a run ends before its last step: on a stop signal (saved, resumable), after a run of
non-finite steps, or when a collective gives up on a stuck or lost rank (the job ends at once).

``TrainingStopped`` is raised on every rank alike; ``CollectiveFailed`` on the rank that gave
up, and ``llama_cp.train.cli`` then calls its ``end_job``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from llama_cp.config import TrainConfig
from llama_cp.train.checkpoint_files import checkpoint_dir, latest_checkpoint
from llama_cp.train.run_dir import plot_losses

#: Signals that stop training gracefully: finish the step, save, exit (Note [Stopping on a signal]).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (a stop signal, a run of non-finite steps); raised on every rank."""

    same_on_every_rank = True


class CollectiveFailed(RuntimeError):
    """A collective timed out or lost a peer: another rank is stuck or gone (Note [Stuck ranks])."""

    def __init__(self, message: str, local_peers: list[tuple[int, int, int]] = ()):
        super().__init__(message)
        self.local_peers = list(local_peers)

    def end_job(self) -> None:
        """After the message is out: end the job's other ranks on this machine and this process
        now, without Python's teardown (see Note [Stuck ranks]). Does not return."""
        from llama_cp.parallel.mesh import end_processes

        end_processes(self.local_peers)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


# Note [Stuck ranks]
# ~~~~~~~~~~~~~~~~~~
# A rank that stops answering (SIGSTOP, hung storage, a dead node) leaves the others
# blocked in their next collective. --collective_timeout bounds that wait (it is the
# process group's timeout, inherited by the mesh's groups); the rank that gives up
# raises CollectiveFailed, naming itself, the step it was in and what the job's other
# ranks on its machine are doing ("rank 1 is stopped"), and the command line prints it.
# Then the job must end now, and two things would delay it:
#
#   timeout ──> message ──> Python's teardown ──> exit ──> torchrun: SIGTERM to the rest,
#                           (GC of the model,              30 s for them to exit, SIGKILL
#                            seconds on a busy CPU)        (a stopped rank ignores SIGTERM)
#
# so CollectiveFailed.end_job SIGKILLs the job's other ranks on this machine (pid and
# start time exchanged at setup, so no other process can be hit; the healthy ones were
# about to time out too) and leaves with os._exit(1). torchrun finds every worker gone
# and ends the job at once: timeout + about a second (docs/reliability.md). The message
# is printed before anything is killed, so when two ranks give up together, the first
# to kill has already spoken. Other machines' ranks time out on their own and do the
# same there (srun --kill-on-bad-exit ends a node whose only rank is the stuck one).
# With gloo the failing collective raises; with NCCL its watchdog aborts the process
# after the same timeout with NCCL's own report, and torchrun's --shutdown_timeout
# (default 30 s) bounds the wait for a stopped rank.


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out or lost its peer (gloo raises
    RuntimeError, NCCL DistBackendError)."""
    text = str(error).lower()
    return isinstance(error, dist.DistBackendError) or any(
        marker in text for marker in ("timed out", "timeout", "connection closed by peer", "connection reset by peer")
    )


def collective_failure(
    error: BaseException, cfg: TrainConfig, where: str, local_peers: list[tuple[int, int, int]]
) -> CollectiveFailed | None:
    """The :class:`CollectiveFailed` to raise in place of ``error`` when it is a collective giving
    up on another rank (not an error every rank raises alike), else None. ``where``: what the
    run was doing ("in step 3"); ``local_peers``: the job's other ranks on this machine."""
    if not isinstance(error, RuntimeError) or getattr(error, "same_on_every_rank", False) \
            or not is_collective_failure(error):
        return None
    from llama_cp.parallel.mesh import peer_states

    saved = latest_checkpoint(cfg.output_dir)
    reason = " ".join(str(error).split())
    reason = reason[reason.rfind("] ") + 2:] if "] " in reason else reason  # drop gloo's source location
    states = peer_states(local_peers)
    seen = "".join(f"; on this machine rank {rank} is {state}" for rank, state in sorted(states.items()))
    message = (
        f"gave up waiting for a collective {where} ({reason[:200]}): another rank is stuck "
        f"(stopped, hung I/O), died or lost its network{seen}; "
        f"--collective_timeout is {cfg.collective_timeout:g} s. "
        + (f"The newest checkpoint is {saved}: resume with --resume once the faulty rank is gone"
           if saved else "No checkpoint was saved yet")
    )
    return CollectiveFailed(message, local_peers)


# Note [Stopping on a signal]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Clusters stop jobs with SIGTERM (SLURM at pre-emption or the time limit, k8s on
# eviction; torchrun forwards it to its workers and waits 30 s before SIGKILL), and
# SLURM can send SIGUSR1 ahead of time (``#SBATCH --signal=USR1@300``). The handler
# only records the signal. Before each step the ranks agree (an all-reduce MAX of
# the signal number: one rank's signal stops them all at the same step); then they
# save the current step, unless it is saved already, and raise TrainingStopped:
# "stopped by SIGTERM after step N: saved ...; resume with --resume".


class StopSignals:
    """Records a STOP_SIGNAL between :meth:`catch` and :meth:`restore` instead of dying on it
    (Note [Stopping on a signal])."""

    def __init__(self):
        self.received = 0  # the last stop signal's number, 0: none
        self._previous: dict = {}

    def catch(self) -> None:
        """Install the recording handlers (only the main thread can), keeping the previous ones."""
        self.received = 0
        if threading.current_thread() is not threading.main_thread():
            return

        def record(signum, frame):
            self.received = signum

        self._previous = {signum: signal.signal(signum, record) for signum in STOP_SIGNALS}

    def restore(self) -> None:
        """Put back the handlers :meth:`catch` replaced."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def stop_if_signalled(self, step: int, saved_step: int | None, device: torch.device,
                          save: Callable[[int], str], output_dir: str) -> None:
        """A collective, before every step: when any rank got a stop signal, save ``step`` with
        ``save`` (unless ``saved_step`` is it) and raise :class:`TrainingStopped` on every rank."""
        received = torch.tensor([self.received], dtype=torch.int64, device=device)
        dist.all_reduce(received, op=dist.ReduceOp.MAX)
        if not received.item():
            return
        name = signal.Signals(int(received.item())).name
        if step == 0:
            raise TrainingStopped(f"stopped by {name} before the first step: nothing to save")
        path = save(step) if saved_step != step else checkpoint_dir(output_dir, step)
        raise TrainingStopped(f"stopped by {name} after step {step}: saved {path}; resume with --resume")


def stop_nonfinite(steps: list[int], cfg: TrainConfig, rank: int) -> None:
    """Raise :class:`TrainingStopped` after ``steps``, a run of steps whose loss or gradient norm
    was not finite, saying where the last finite weights are; rank 0 first redraws loss.png."""
    saved = latest_checkpoint(cfg.output_dir)
    if saved:
        where = f"the newest checkpoint, {saved}, holds the last finite weights"
        then = "then continue from it with --resume"
    else:
        where = "no checkpoint was saved, so there is nothing to resume"
        then = "then start again (--overwrite, or another --output_dir)"
    if rank == 0:  # the plot marks the skipped steps
        plot_losses(os.path.join(cfg.output_dir, "metrics.jsonl"), os.path.join(cfg.output_dir, "loss.png"))
    raise TrainingStopped(
        f"loss or gradient norm was NaN/inf at steps {steps[0]}-{steps[-1]} ({len(steps)} steps in a row, "
        f"--max_nonfinite_steps {cfg.max_nonfinite_steps}); those steps changed no weight, and training "
        f"stopped without saving or exporting; {where}. Lower --lr (now {cfg.optim.lr:g}) or "
        f"--max_grad_norm, or check the data, {then}"
    )
