"""Run :meth:`Trainer.fit` on several local processes from a notebook or a script.

    from llama_cp import TrainConfig, launch
    row = launch(TrainConfig.from_flags(cp=2, max_steps=3), nprocs=2)

The in-process equivalent of ``torchrun --standalone --nproc_per_node N``:
each child gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), so :func:`llama_cp.parallel.mesh.init_distributed` is the
same code path as under torchrun; on a CUDA machine child ``i`` uses GPU ``i``.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llama_cp.config import TrainConfig
from llama_cp.files import write_text
from llama_cp.parallel.mesh import end_distributed, free_port

_RESULT_FILE = "rank0_metrics.json"


def launch(cfg: TrainConfig, nprocs: int, *, master_port: int | None = None) -> dict[str, Any]:
    """Train ``cfg`` on ``nprocs`` spawned local processes; return rank 0's last metrics row.

    Always spawns, even for ``nprocs=1``, so the calling process (a notebook
    kernel) never holds a process group and can call ``launch`` again.
    ``master_port=None`` picks a free port. A failure in any child is raised
    here (``torch.multiprocessing.ProcessRaisedException`` with the child's
    traceback, or ``ProcessExitedException`` when it died); the other children
    are terminated.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if torch.cuda.is_available() and nprocs > torch.cuda.device_count():
        raise ValueError(f"nprocs({nprocs}) > visible CUDA devices({torch.cuda.device_count()}): one GPU per process")
    port = master_port if master_port is not None else free_port()
    with tempfile.TemporaryDirectory(prefix="llama_cp_launch_") as result_dir:
        # the result goes through a file, not a Queue: nothing can block a child's exit
        mp.start_processes(
            _run_rank, args=(cfg, nprocs, port, result_dir), nprocs=nprocs, join=True, start_method="spawn"
        )
        with open(os.path.join(result_dir, _RESULT_FILE)) as f:
            return json.load(f)


def _run_rank(rank: int, cfg: TrainConfig, world_size: int, port: int, result_dir: str) -> None:
    """One child: torchrun's environment, fit, rank 0 writes its row, leave with :func:`end_distributed`."""
    from llama_cp.train.trainer import Trainer

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        # like torchrun, don't let N processes each take every core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        row = Trainer(cfg).fit()
    except BaseException:
        # torch's spawn wrapper writes the traceback for the parent, then the child exits
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    if rank == 0:
        write_text(os.path.join(result_dir, _RESULT_FILE), json.dumps(row))
    # A spawned child's interpreter finalizes like a script's, where a gloo worker can abort the
    # finished rank (Note [Leaving a gloo job] in llama_cp/parallel/mesh.py): this function is the child's
    # whole program, so it leaves the way a script does.
    end_distributed()

