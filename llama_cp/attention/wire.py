"""Metering of context-parallel attention's communication: the bytes this rank sends to other
ranks, by transfer kind. ``with wire_bytes() as meter`` counts what the attention calls inside
the block send; every strategy reports its transfers here (``_count``) as it posts them
(tests/attention/test_documents.py checks the counts against the formulas; docs/benchmarks.md has the
figures)."""

from __future__ import annotations

import collections
import contextlib


class WireMeter:
    """Bytes this rank sends to other ranks for context-parallel attention, by transfer kind
    (``sent``: kind -> bytes). The ring's transfers are counted as posted; a collective as the
    data it must move from this rank: an all-gather its shard to cp - 1 ranks, an all-to-all
    or reduce-scatter the (cp - 1) / cp of its input meant for others."""

    def __init__(self):
        self.sent: collections.Counter[str] = collections.Counter()


_METERS: list[WireMeter] = []


@contextlib.contextmanager
def wire_bytes():
    """Count the bytes sent by the attention calls inside the block: ``with wire_bytes() as meter``."""
    meter = WireMeter()
    _METERS.append(meter)
    try:
        yield meter
    finally:
        _METERS.remove(meter)


def _count(kind: str, nbytes: float) -> None:
    for meter in _METERS:
        meter.sent[kind] += int(nbytes)
