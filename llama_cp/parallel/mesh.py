"""The device mesh: ``dp_replicate x dp_shard x cp``.

Mesh dims (always present, size 1 allowed):

- ``dp_replicate``: HSDP replicas (usually across nodes).
- ``dp_shard``: FSDP shards parameters within a replica.
- ``cp``: context parallelism; ranks of one cp group hold one sample between them.

Flattened views:

- ``dp_shard_cp``: FSDP shards parameters, gradients and optimizer state over it
  (the ranks of a cp group hold the same parameters, so they shard them too).
- ``dp`` (``dp_replicate x dp_shard``): the data loader; ranks of one cp group
  read the same sample.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llama_cp.parallel.collectives import warm_up_group

MESH_DIMS = ("dp_replicate", "dp_shard", "cp")

#: The sub-meshes ``build_mesh`` keeps on the mesh (see :func:`submesh`).
KEPT_MESHES = ("dp_shard_cp", "dp", ("dp_replicate", "dp_shard_cp"))


def submesh(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """``mesh[names]``: the sub-mesh kept by :meth:`ParallelDims.build_mesh` when there is one.

    torch >= 2.11 warns when a flattened dim ("dp", "dp_shard_cp") is sliced from the root
    mesh and asks callers to keep the flattened meshes themselves; the library does, and
    looks them up here. ``mesh["dp_shard_cp"]`` still works for user code (with torch's warning).
    """
    key = names[0] if len(names) == 1 else names
    kept = getattr(mesh, "_llama_cp_kept", {})
    return kept[key] if key in kept else mesh[key]


@dataclass
class ParallelDims:
    """Parallel degrees of a job, validated against the world size.

    ``dp_shard=-1`` takes what is left: world_size / (dp_replicate x cp).
    ``world_size`` defaults to the initialised process group's.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    world_size: int | None = None

    def __post_init__(self) -> None:
        if self.world_size is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "ParallelDims needs world_size, or torch.distributed.init_process_group() called first"
                )
            self.world_size = dist.get_world_size()
        for name in ("dp_replicate", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard == -1:
            if self.world_size % (self.dp_replicate * self.cp):
                raise ValueError(
                    f"world_size({self.world_size}) is not divisible by dp_replicate({self.dp_replicate}) * "
                    f"cp({self.cp}), so dp_shard=-1 cannot be inferred"
                )
            self.dp_shard = self.world_size // (self.dp_replicate * self.cp)
        if self.dp_shard < 1:
            raise ValueError(f"dp_shard must be >= 1 or -1 (infer), got {self.dp_shard}")
        if self.dp_replicate * self.dp_shard * self.cp != self.world_size:
            raise ValueError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) "
                f"!= world_size({self.world_size})"
            )

    @property
    def dp(self) -> int:
        """Number of data-parallel replicas of the sequence (ranks reading different samples)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks that shard one copy of the parameters (dp_shard x cp)."""
        return self.dp_shard * self.cp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A 3-D mesh over ``MESH_DIMS`` with the flattened ``dp_shard_cp`` and ``dp`` views."""
        mesh = init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard, self.cp), mesh_dim_names=MESH_DIMS
        )
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        with warnings.catch_warnings():  # slicing them once here is what torch's warning asks for
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
            mesh._llama_cp_kept = {key: mesh[key] for key in KEPT_MESHES}
        for dim in (*MESH_DIMS, "dp_shard_cp", "dp"):  # Note [Warming up a group] in llama_cp/parallel/collectives.py
            warm_up_group(submesh(mesh, dim).get_group())
        return mesh


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; a rendezvous binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_device_type() -> str:
    """The device type this machine trains on: "cuda" when CUDA is available, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: float | None = None, cpu_collectives: bool = False) -> str:
    """Initialise the default process group from torchrun's environment (or as a single
    process) and return the device type: cuda + nccl when CUDA is available, else cpu + gloo.

    ``timeout_s``: how long a collective (of this group and of every group made from it,
    the mesh's included) waits for the other ranks before it fails; None keeps the
    backend's default. ``cpu_collectives``: on CUDA also gloo for CPU tensors ("cuda:nccl,cpu:gloo"),
    which --offload_params needs (gradient clipping all-reduces the norms of CPU gradients). An
    already initialised group is left as it is."""
    device_type = machine_device_type()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m ...`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))  # several runs may share a machine
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if device_type == "cuda":
            expandable_segments()
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        backend = ("cuda:nccl,cpu:gloo" if cpu_collectives else "nccl") if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timeout)
    return device_type


#: The environment variables through which a user configures torch's CUDA caching allocator
#: (PYTORCH_ALLOC_CONF is the newer name, read by torch >= 2.9 too; ROCm builds read the HIP one).
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def user_allocator_settings() -> dict[str, str]:
    """The user's configuration of the caching allocator: those of ``ALLOCATOR_VARIABLES`` that are
    set (to anything, even empty)."""
    return {name: os.environ[name] for name in ALLOCATOR_VARIABLES if name in os.environ}


def expandable_segments() -> bool:
    """Turn on the CUDA caching allocator's expandable segments, unless the user configured the
    allocator (:func:`user_allocator_settings`): Note [Expandable segments]. Returns whether it
    did. :func:`init_distributed` calls it on CUDA, before the first allocation."""
    if user_allocator_settings():
        return False
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    return True


# Note [Expandable segments]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A long-context step allocates a few tensors of many GiB (at 516,096 tokens of Llama 3 8B, one
# MLP intermediate is 13.8 GiB) between many small ones, and the caching allocator, which keeps
# the fixed-size segments it got from cudaMalloc, can hold the free bytes in pieces too small for
# the next big block. On one H200 (docs/benchmarks.md, run 5) the step the planner had sized at
# 125.4 GiB failed asking for 13.78 GiB with 111.70 GiB allocated, that is at the planned peak,
# while 17.79 GiB were reserved by torch but unallocated. Expandable segments map physical pages
# into one growing virtual range per stream, so freed pages are reused whatever the sizes: the
# same step with them (run 6) ran about 100 s without failing, where run 5 failed 35 s into it,
# until the part's time limit stopped it before the step ended. So it is our default, as a
# launcher's PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would be, but set in-process (the
# runtime form torch's own test runner uses, torch._C._accelerator_setAllocatorSettings, present
# in torch 2.10 to 2.13; it applies to segments made after it), so `python -m ...`, torchrun and a
# notebook get it alike. A user who sets any of the variables keeps exactly their setting (also
# "expandable_segments:False", or cudaMallocAsync, which has no such option). The call parses a
# whole configuration (c10/core/AllocatorConfig.cpp), so settings made earlier in the process by
# the same call, not by a variable (max_split_size_mb and the like), go back to their defaults.


def end_distributed() -> None:
    """The last line of a script that used the process group: tear the default group down,
    flush stdout and stderr, and leave at once with ``os._exit(0)``, without the
    interpreter's finalization (Note [Leaving a gloo job]). Close your own files first;
    call it only where the process's own program ends: a script's top level (``__main__``)
    or the end of a spawned child's function, never from a library."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Note [Leaving a gloo job]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A finished gloo job (the CPU backend) can still abort at exit: "terminate called without an
# active exception", SIGABRT, and torchrun reports the job as failed. Read from a core dump of
# the README loop (torch 2.13.0, CPython 3.11.7, gdb): the aborting thread is a gloo worker in
# ProcessGroupGloo::runLoop destroying an AsyncAllreduceWork that had already completed (the
# caller's wait() had returned); dropping its output tensors calls TensorImpl::decref_pyobject,
# which takes the GIL, and CPython ends any thread that takes the GIL once the interpreter is
# finalizing (PyThread_exit_thread -> pthread_exit); that forced unwind crosses a noexcept
# destructor, hence std::terminate. So it happens when the worker is descheduled between
# completing the work and releasing it for longer than the main thread takes to reach
# finalization: rare, and more likely on a loaded machine. destroy_process_group() does not
# prevent it (the groups live on in the device mesh and the model, and a completed work may
# still be held by its worker). Measured with the README loop, 2 jobs of 2 gloo ranks at once
# on 2 cores: ending with dist.destroy_process_group(), 3 of 70 runs aborted; ending with
# end_distributed(), none of 40. torch has no fix (pytorch/pytorch#179291, an atexit
# destroy_process_group, was abandoned), so a job leaves before finalization: the process
# group is torn down, the standard streams flushed, and nothing that could run a gloo
# worker's release under a finalizing interpreter is left to run. A child started by
# torch.multiprocessing (spawn) finalizes too: multiprocessing's spawn_main ends with
# sys.exit once the child's function returns. So launch()'s children and the test harness's
# ranks end with end_distributed() as well; a CI run of the notebook's launch(cp=2) lost
# rank 1 to this SIGABRT after its training had finished.


# ----------------------------------------------------------------------------- ending a stuck job
# See Note [Stuck ranks] in llama_cp/train/failures.py.


def local_peers() -> list[tuple[int, int, int]]:
    """The job's other ranks on this machine as ``(rank, pid, start time)``; a collective over
    the default group. Empty off Linux (no ``/proc``) or on a machine of its own.

    Two ranks are on one machine when they share the kernel (its boot id) and the pid
    namespace, so a pid means the same process to both; the start time (clock ticks since
    boot) tells that process from a later one that got the same pid."""
    me = _process_identity()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    return [
        (rank, found[1], found[2])
        for rank, found in enumerate(everyone)
        if me is not None and found is not None and found[0] == me[0] and rank != dist.get_rank()
    ]


def peer_states(peers: list[tuple[int, int, int]]) -> dict[int, str]:
    """What each of ``local_peers()`` is doing now, when that can explain a stuck job:
    ``"stopped"`` (SIGSTOP, a debugger), ``"in uninterruptible I/O"`` or ``"gone"``."""
    words = {"T": "stopped", "t": "stopped", "D": "in uninterruptible I/O", "Z": "gone", "X": "gone"}
    states = {}
    for rank, pid, start in peers:
        stat = _read_stat(pid)
        state = "gone" if stat is None or stat[1] != start else words.get(stat[0])
        if state is not None:
            states[rank] = state
    return states


def end_processes(peers: list[tuple[int, int, int]]) -> list[int]:
    """SIGKILL each ``(rank, pid, start time)`` that is still that process; returns their ranks."""
    ended = []
    for rank, pid, start in peers:
        stat = _read_stat(pid)
        if stat is None or stat[1] != start:  # gone, or the pid is another process's now
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            ended.append(rank)
        except (ProcessLookupError, PermissionError):
            pass
    return ended


def _process_identity() -> tuple[tuple[str, int], int, int] | None:
    """``((boot id, pid namespace), pid, start time)`` of this process; None without ``/proc``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    stat = _read_stat(os.getpid())
    return None if stat is None else ((boot, namespace), os.getpid(), stat[1])


def _read_stat(pid: int) -> tuple[str, int] | None:
    """``(state letter, start time in clock ticks since boot)`` from ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (name)", which may hold spaces
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)
