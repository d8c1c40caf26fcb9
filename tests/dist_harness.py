"""Run many multi-rank checks inside one gloo process group per test module.

A test module registers checks with ``checks = Checks()`` and ``@checks.add``,
then exposes them to pytest as one module fixture and one test per check::

    checks = Checks()

    @checks.add
    def ring_matches_reference():
        ...  # runs on every rank; raise (assert) on failure

    results = checks.module_fixture(__name__, world_size=4)

    @pytest.mark.parametrize("name", checks.names)
    def test_check(results, name):
        checks.assert_passed(results, name)

Every rank runs every selected check in order (collectives must line up); a
check fails if it raised on any rank, and the test shows that rank's traceback.

A check that uses only a group of ``group`` consecutive ranks (``@checks.add`` with
``group=``: the cp group of a mesh whose other dims it leaves alone, a group of one rank) runs
on one such group only, next to other checks of its size on the other groups (Note [Checks side
by side]); the meshes they use are built by every rank first, in ``Checks(setup=...)``.

Selecting tests selects checks: the ranks run only the checks whose tests pytest
collected (node ids, ``-k``, ``-m``, ``--lf``; tests/conftest.py hands them to each
module's ``Checks.select``). So ``pytest "tests/attention/test_windows.py::test_check[ring_cp2_plain_float32]"``
starts one process group that runs that one check, and a module none of whose tests
is selected starts none.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import shutil
import tempfile
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import tqdm

from llama_cp.parallel.mesh import end_distributed, free_port

# Note [Ranks forked from a preloaded server]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A spawned rank starts a fresh interpreter and imports torch, transformers' modeling code, peft
# and llama_cp: 3-5 s of CPU each, 4 ranks per module, a dozen modules, on 2 cores (about 90 s of
# the suite's wall time). The ranks are forked instead from multiprocessing's fork server, one
# process per pytest session that imports the modules below once (the first module's ranks wait
# for it): each rank starts with them imported and imports only its test module. The server
# is a clean single-threaded process, not pytest's own (forking pytest would copy the threads and
# state of whatever ran before: tqdm's monitor, TensorBoard writers, torch's thread pool).
# Measured (2 cores): test_documents, test_windows, test_cp_attention and test_fsdp 63 s spawned,
# 40 s forked from the server.
mp.set_forkserver_preload(["dist_harness", "llama_cp.train.trainer", "llama_cp.data.loader", "peft",
                           "transformers.models.llama.modeling_llama"])


# Note [Checks side by side]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A check of a cp-2 mesh without FSDP (dp_shard 2 x cp 2 on 4 ranks) runs the same computation on
# both cp groups, and a cp-1 check the same single-process computation on every rank: on 2 cores
# the copies cost as much as the check. A check registered with ``group=g`` uses only its group of
# g consecutive ranks (ranks g*i .. g*i + g - 1: a mesh's cp group, as ParallelDims orders the
# ranks), so the world runs world / g different ones at once:
#
#     group=2 checks a, b, c, d, e:   ranks 0 1 | ranks 2 3
#                                     a, c, e   | b, d
#     then the world's checks:        ranks 0 1 2 3, in order
#
# The selected checks of each group size are dealt to the groups in order of registration and run
# before the world's checks; a check still compares with its single-process reference on every
# rank of its group, and a rank outside the group reports it passed. The meshes the group checks
# use are made by every rank before them (``Checks(setup=...)``, given the group sizes): a group
# check must make no new group, and run no collective outside its own.


# Note [Worlds side by side]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# A module whose checks each need a whole world of their own (the trainer in a world of one: it
# uses the default process group, so a check of ``group=`` cannot hold it) runs them one after the
# other on one core, the other idle. ``Checks(worlds=n)`` runs n independent worlds at once, each
# its own process group (its own port) of ``world_size`` ranks; the selected checks are dealt to the
# worlds in order of registration (check i to world i % n), and each world runs its share in order:
#
#     worlds=2, checks a, b, c, d, e:   world 0 (1 rank): a, c, e  |  world 1 (1 rank): b, d
#
# A check's result is that of the ranks of the world that ran it. A check must not rely on another
# having run before it in the same process (each still runs in a rank forked from the server).


def _my_checks(module_checks, names: list[str], rank: int, world_size: int) -> list[tuple[str, callable]]:
    """The checks this rank runs, in order: its share of each group size's (Note [Checks side by
    side]), then every world check."""
    mine, dealt = [], {}  # group size -> checks dealt so far
    for name, fn in module_checks.items:
        if name not in names:
            continue
        group = module_checks.groups.get(name, world_size)
        assert world_size % group == 0, f"{name}: groups of {group} ranks do not divide a world of {world_size}"
        if group < world_size:
            index = dealt[group] = dealt.get(group, -1) + 1
            if index % (world_size // group) == rank // group:
                mine.append((name, fn))
    return mine + [(name, fn) for name, fn in module_checks.items
                   if name in names and module_checks.groups.get(name, world_size) >= world_size]


def _worker(rank: int, world_size: int, port: int, module_name: str, out_dir: str, names: list[str],
            environ: dict[str, str], cwd: str) -> None:
    # the fork server's environment and directory are those of its start: take the parent's now, as a spawned rank would
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_num_threads(1)
    # tqdm's default lock holds a multiprocessing semaphore, registered with the resource tracker of the
    # pytest process; a rank leaves by os._exit, without unregistering it, and the tracker then warns of
    # "leaked semaphore objects" at the session's end (one per rank that showed a bar). A thread lock.
    tqdm.tqdm.set_lock(threading.RLock())
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=90),
    )
    module = importlib.import_module(module_name)
    sizes = {module.checks.groups[name] for name in names if module.checks.groups.get(name, world_size) < world_size}
    if sizes:
        module.checks.setup(sizes)
    results: dict[str, str | None] = {name: None for name in names}  # another group's checks: passed here
    seconds: dict[str, tuple[float, float]] = {}  # name -> (wall, CPU) on this rank
    for name, fn in _my_checks(module.checks, names, rank, world_size):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            fn()
        except (Exception, pytest.fail.Exception):  # recorded and reported by pytest in the parent
            results[name] = f"rank {rank}:\n{traceback.format_exc()}"
        seconds[name] = (time.perf_counter() - wall, time.process_time() - cpu)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if os.environ.get("LLAMA_CP_CHECK_SECONDS"):  # a folder: each rank's seconds per check, to find the slow ones
        world = os.path.basename(out_dir) if os.path.basename(out_dir).startswith("world") else ""
        with open(os.path.join(os.environ["LLAMA_CP_CHECK_SECONDS"],
                               f"{module_name}.{world + '.' if world else ''}rank{rank}.json"), "w") as f:
            json.dump(seconds, f)
    end_distributed()  # Note [Leaving a gloo job] in llama_cp/parallel/mesh.py


def _world_worker(index: int, world_size: int, ports: list[int], module_name: str, out_dirs: list[str],
                  shares: list[list[str]], environ: dict[str, str], cwd: str) -> None:
    """Process ``index`` of Note [Worlds side by side]: rank ``index % world_size`` of world ``index // world_size``."""
    world, rank = divmod(index, world_size)
    _worker(rank, world_size, ports[world], module_name, out_dirs[world], shares[world], environ, cwd)


class Checks:
    def __init__(self, setup=None, worlds: int = 1) -> None:
        """``setup(sizes)``: run by every rank before the checks, with the group sizes of the selected
        checks of ``group=``; it makes what they need made by every rank (their meshes: Note [Checks
        side by side]). ``worlds``: independent worlds that run the checks at once, dealt between
        them (Note [Worlds side by side])."""
        self.items: list[tuple[str, callable]] = []
        self.skips: dict[str, str] = {}  # name -> why it does not run here
        self.groups: dict[str, int] = {}  # name -> the size of the rank group it runs on (Note [Checks side by side])
        self.setup = setup
        self.worlds = worlds
        self.selected: set[str] | None = None  # the names whose tests pytest selected; None: every name

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.items]

    def add(self, fn=None, name: str | None = None, *, skip: str | None = None, group: int | None = None):
        """Register ``fn`` (no arguments) under ``name`` (default: its __name__); usable as a decorator
        (``@checks.add(group=1)`` too). ``skip``: why it cannot run here (it is then not run, and
        reported as skipped). ``group``: it uses only its group of that many consecutive ranks, and
        runs on one group, next to others (Note [Checks side by side])."""
        if fn is None:
            return functools.partial(self.add, name=name, skip=skip, group=group)
        name = name or fn.__name__
        self.items.append((name, fn))
        if skip:
            self.skips[name] = skip
        if group:
            self.groups[name] = group
        return fn

    def select(self, names) -> None:
        """Run only the checks of ``names`` (called by tests/conftest.py with the checks whose tests
        pytest collected); the others are not run, and report "not run" if asked for."""
        unknown = set(names) - set(self.names)
        if unknown:
            raise ValueError(f"no such checks: {', '.join(sorted(unknown))}")
        self.selected = set(names)

    @property
    def to_run(self) -> list[str]:
        """The names of the checks the ranks run: selected, and not skipped here."""
        return [name for name in self.names
                if name not in self.skips and (self.selected is None or name in self.selected)]

    def run(self, module_name: str, world_size: int) -> dict[str, list[str | None]]:
        """Run :attr:`to_run` on ``world_size`` gloo ranks (Note [Ranks forked from a preloaded server]),
        in :attr:`worlds` worlds side by side (Note [Worlds side by side]): name -> per rank, None
        (passed) or the traceback."""
        names = self.to_run
        worlds = max(1, min(self.worlds, len(names)))
        shares = [names[world::worlds] for world in range(worlds)]
        with tempfile.TemporaryDirectory() as out_dir:
            if worlds == 1:
                mp.start_processes(
                    _worker, args=(world_size, free_port(), module_name, out_dir, names, dict(os.environ),
                                   os.getcwd()),
                    nprocs=world_size, start_method="forkserver", join=True,
                )
                out_dirs = [out_dir]
            else:
                out_dirs = [os.path.join(out_dir, f"world{world}") for world in range(worlds)]
                for path in out_dirs:
                    os.mkdir(path)
                ports = [free_port() for _ in range(worlds)]
                while len(set(ports)) < worlds:  # a port handed out twice: ask again
                    ports = [free_port() for _ in range(worlds)]
                mp.start_processes(
                    _world_worker, args=(world_size, ports, module_name, out_dirs, shares, dict(os.environ),
                                         os.getcwd()),
                    nprocs=worlds * world_size, start_method="forkserver", join=True,
                )
            ran = {}  # name -> per rank of the world that ran it
            for path, share in zip(out_dirs, shares, strict=True):
                per_rank = []
                for rank in range(world_size):
                    with open(os.path.join(path, f"rank{rank}.json")) as f:
                        per_rank.append(json.load(f))
                ran.update({name: [r.get(name, "not run") for r in per_rank] for name in share})
        return {name: ran.get(name, [None if name in self.skips else "not run"] * world_size) for name in self.names}

    def module_fixture(self, module_name: str, world_size: int):
        @pytest.fixture(scope="module")
        def results():
            return self.run(module_name, world_size)

        return results

    def assert_passed(self, results: dict[str, list[str | None]], name: str) -> None:
        if name in self.skips:
            pytest.skip(self.skips[name])
        failures = [r for r in results[name] if r is not None]
        if failures:
            pytest.fail(failures[0], pytrace=False)


def map_in_processes(fn, items: list, processes: int = 2) -> list:
    """``[fn(item) for item in items]``, computed in ``processes`` processes forked from the server of
    Note [Ranks forked from a preloaded server] (``fn`` importable by name, results pickled back):
    work that runs in one thread (the planner under fake tensors) on every core."""
    with mp.get_context("forkserver").Pool(processes) as pool:
        return pool.map(fn, items, chunksize=1)


@contextlib.contextmanager
def shared_tmpdir(prefix: str | None = None):
    """One temporary directory for every rank of a check (made by rank 0, its path broadcast),
    removed by rank 0 once every rank is done with it."""
    path = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    try:
        yield path[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0])
