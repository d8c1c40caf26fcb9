"""The torch.distributed calls whose names or rules differ across what the package admits.

- :func:`all_gather_into` / :func:`reduce_scatter_into`: one tensor in, one tensor out, under
  the name the running torch has (Note [Collective names across torch versions]).
- :func:`warm_up_group`: a one-element all-reduce on a new process group, so that its first
  batched point-to-point call may involve only some of its ranks (Note [Warming up a group]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Note [Collective names across torch versions]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch 2.13 added ``all_gather_single`` and ``reduce_scatter_single`` and deprecated the
# names they replace, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (a FutureWarning
# from c10d_logger on each call; torch/distributed/distributed_c10d.py, 2.13.0). torch 2.10-2.12,
# which setup.cfg admits, have only the old names. Both take (output, input, group=...) with
# the output the concatenation of the ranks' inputs along dim 0 (all-gather) and the input the
# concatenation of the ranks' parts (reduce-scatter, a sum by default), so the call is the same
# under either name. The name is looked up at each call, not once at import, so a test can take
# the new names away and run the all-gather strategy as torch 2.10 would
# (tests/attention/test_documents.py). tests/test_torch_floor.py holds every torch.distributed name the
# package uses to what torch 2.10.0 has.


def _named(new: str, old: str):
    found = getattr(dist, new, None)
    return found if found is not None else getattr(dist, old)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` (cp * n, ...) <- every rank's ``input`` (n, ...) in group-rank order."""
    _named("all_gather_single", "all_gather_into_tensor")(output, input, group=group)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` (n, ...) <- the sum over the ranks of their ``input`` (cp * n, ...)'s part of this rank."""
    _named("reduce_scatter_single", "reduce_scatter_tensor")(output, input, group=group)


# Note [Warming up a group]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# NCCL creates a group's communicator lazily, at the group's first call, and creating it is
# itself collective: every rank of the group must take part. torch says so for batched P2P
# (``batch_isend_irecv``'s docstring, torch/distributed/distributed_c10d.py, 2.10.0 and 2.13.0):
# "if this API is the first collective call in the group passed to dist.P2POp, all ranks of the
# group must participate in this API call; otherwise, the behavior is undefined". The ring's
# transfers are batched P2P, and with packed documents (Note [Ring transfers] in
# llama_cp/attention/ring.py) a rank posts nothing at a step where none of its queries sees the
# block in flight: were that the group's first call, the ranks that did post would wait for a
# communicator the others never create, until the watchdog ends the job. Nothing else may run
# on a ring's group first: the cp group of the mesh carries only attention traffic (FSDP uses
# dp_shard_cp), and hybrid's outer groups are made by ``new_group`` for the ring alone. So each
# group the package makes gets a one-element all-reduce on its device right after it is made:
# every rank of the group takes part, the communicator exists before any partial batch. On gloo
# (CPU) the all-reduce is harmless and cheap; there communicators are made eagerly anyway, so
# no CPU test can show the hang: tests/attention/test_documents.py checks the rule instead (no
# batched P2P on a group before a collective of all of its ranks).


def warm_up_group(group: dist.ProcessGroup) -> None:
    """Run a one-element all-reduce on ``group`` (all of its ranks call this), so that its
    communicator exists before a batched P2P of only some ranks (Note [Warming up a group]).
    The tensor is on the device the group's backend serves: the current CUDA device for NCCL,
    else the CPU."""
    nccl = "nccl" in str(dist.get_backend(group)).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    dist.all_reduce(torch.zeros(1, device=device), group=group)
