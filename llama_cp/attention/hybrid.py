"""Hybrid context-parallel attention: Ulysses inside groups of cp ranks, the ring across them.

Note [Hybrid attention]
=======================

Ulysses needs heads % cp == 0, so with 32 heads it stops at cp 32, and its
all-to-all spans the whole cp group (across nodes, where links are slow). The
hybrid strategy (USP's idea) splits cp = u x r: Ulysses inside groups of u
consecutive cp ranks (``--ulysses_degree u``, usually a node), the ring across
the r groups. No new layout is needed: under the zigzag layout of cp, the u
ranks of group j hold exactly the two ring chunks j and 2r-1-j of the zigzag of
r, each rank two of their 2u sub-chunks in the zigzag order of u (cp 4, u 2,
r 2; 8 sub-chunks, ring chunks of 2):

    sub-chunk:    0    1    2    3    4    5    6    7
    cp rank:      0    1    2    3    3    2    1    0
    ring chunk:   0         1         1'        0'        (group 0 = ranks 0, 1 holds 0 and 0')

So Ulysses' own all-to-all (``_seq_to_heads`` over the group of u) leaves each
rank with heads / u heads of its group's two ring chunks in order, which is the
ring's local layout for ring rank j of r; the ring runs over the outer group (the
cp ranks with the same place in their groups) with that layout, documents
included, and the inverse all-to-all returns the output. u = cp is Ulysses,
u = 1 the ring. Needs heads % u == 0 (KV heads are repeated as Ulysses does).
"""

from __future__ import annotations

import math

import torch.distributed as dist

from llama_cp.attention import kernel_calls
from llama_cp.attention.documents import DocumentLayout
from llama_cp.attention.kernels import Backend
from llama_cp.attention.local import local_attention
from llama_cp.attention.ring import _RingAttention
from llama_cp.attention.sinks import local_sinks
from llama_cp.attention.ulysses import _AllToAll, _heads_to_seq, _seq_to_heads
from llama_cp.parallel.collectives import warm_up_group


def check_ulysses_degree(strategy: str, ulysses_degree: int, cp: int, heads: int | None = None,
                         heads_name: str | None = None) -> None:
    """One line naming --ulysses_degree and the fix unless it fits ``strategy``, cp and the heads
    (``heads_name``: how to name them, :func:`llama_cp.modules.layers.attention_heads`)."""
    if strategy != "hybrid":
        if ulysses_degree:
            raise ValueError(f"--ulysses_degree {ulysses_degree} is only read by --cp_strategy hybrid (got "
                             f"{strategy!r}): add --cp_strategy hybrid or drop --ulysses_degree")
        return
    if ulysses_degree < 1 or cp % ulysses_degree:
        raise ValueError(f"--cp_strategy hybrid needs --ulysses_degree, a divisor of --cp {cp} (the Ulysses ranks "
                         f"inside each ring rank), got {ulysses_degree}")
    if heads is not None and heads % ulysses_degree:
        heads_name = heads_name or f"num_attention_heads ({heads})"
        raise ValueError(f"--ulysses_degree {ulysses_degree} must divide {heads_name}: choose a "
                         f"common divisor of {heads} and --cp {cp}")


_HYBRID_GROUPS: dict = {}


def hybrid_groups(group: dist.ProcessGroup, ulysses_degree: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(inner, outer) sub-groups of cp group ``group`` for Note [Hybrid attention]: inner, the
    ``ulysses_degree`` consecutive cp ranks of this rank; outer, every ``ulysses_degree``-th.
    Collective over the default group (new groups are made for every cp group), cached."""
    key = (tuple(dist.get_process_group_ranks(group)), ulysses_degree)
    if key not in _HYBRID_GROUPS:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, key[0])
        u, me, found = ulysses_degree, dist.get_rank(), {}
        for ranks in sorted(set(map(tuple, every))):  # the same new_group calls, in the same order, everywhere
            for kind, members in [*(("inner", ranks[j : j + u]) for j in range(0, len(ranks), u)),
                                  *(("outer", ranks[i::u]) for i in range(u))]:
                new = dist.new_group(list(members))
                if me in members:
                    found[kind] = new
        for new in found.values():  # every group made, each before its first ring transfer
            warm_up_group(new)
        _HYBRID_GROUPS[key] = (found["inner"], found["outer"])
    return _HYBRID_GROUPS[key]


def hybrid_attention(
    q, k, v, inner: dist.ProcessGroup, outer: dist.ProcessGroup, *, causal: bool, scale: float,
    backend: Backend | None = None, documents: DocumentLayout | None = None, block_size: int = 0,
    softcap: float = 0.0, window: int | None = None, sinks=None,
):
    """Ulysses over ``inner``, then the ring over ``outer`` (Note [Hybrid attention]); q: (B, H,
    S/cp, D), k/v: (B, Hkv, S/cp, D) zigzag shards of the cp group. ``documents``: the layout of
    the outer ring (``cp_size`` its size); ``sinks`` (H,): Note [Attention sinks under CP], the
    inner group's slice of the heads. Differentiable."""
    u = dist.get_world_size(inner)
    kv_repeat = u // math.gcd(k.shape[1], u)
    k, v = kernel_calls.expand_kv(k, kv_repeat), kernel_calls.expand_kv(v, kv_repeat)
    q, k, v = (_AllToAll.apply(t, inner, _seq_to_heads, _heads_to_seq) for t in (q, k, v))
    sinks = local_sinks(sinks, inner)
    if dist.get_world_size(outer) == 1:  # u = cp: Ulysses
        block = None if documents is None else documents.ring_pieces(0, window)
        out = local_attention(q, k, v, causal=causal, scale=scale, backend=backend, block_size=block_size, block=block,
                              softcap=softcap, sinks=sinks)
    else:
        out = _RingAttention.apply(q, k, v, outer, causal, scale, backend, documents, block_size, softcap, window,
                                   sinks)
    return _AllToAll.apply(out, inner, _heads_to_seq, _seq_to_heads)
