"""The context-parallel strategies by name, and the one ``--cp_strategy auto`` picks.

Note [Choosing a strategy]
==========================

``--cp_strategy auto`` (``choose_strategy``) decides from the heads, cp and
whether rows are packed (a file or hub dataset with --document_mask):

- packed rows: allgather. Document-aware sharding makes the ranks' step work
  equal within 0.2% where the zigzag layout leaves the busiest rank of the
  worst row up to 59% over the mean at cp 8 (docs/benchmarks.md, balance). It
  sends more than Ulysses (Llama-3-8B, 131K tokens, cp 4: 48 GiB per rank per
  step against 30), a small part of a step on NVLink; the busiest rank's extra
  attention work is not.
- one document per row and heads % cp == 0: Ulysses, the fewest bytes per step
  of the strategies that need no packing (30 GiB in that example, against 56
  for the ring), in one all-to-all round per tensor.
- otherwise hybrid with u = gcd(heads, cp) when that is > 1, else the ring.

The basis is the bytes and balance tables of docs/benchmarks.md; the CPU step
times there do not separate the strategies (compute-bound, within 5%), no GPU
has measured them yet, and a GPU's overlap of the ring's transfers with its
compute may favour the ring over what bytes alone say.
"""

from __future__ import annotations

import math
from typing import Literal

Strategy = Literal["ring", "ulysses", "allgather", "hybrid"]
STRATEGIES: tuple[str, ...] = ("ring", "ulysses", "allgather", "hybrid")


def choose_strategy(heads: int, cp: int, packed: bool) -> tuple[Strategy, int]:
    """``--cp_strategy auto``: (strategy, ulysses_degree) by Note [Choosing a strategy]."""
    if cp == 1:
        return "ring", 0
    if packed:
        return "allgather", 0
    if heads % cp == 0:
        return "ulysses", 0
    u = math.gcd(heads, cp)
    return ("hybrid", u) if u > 1 else ("ring", 0)
