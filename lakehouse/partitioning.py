"""How a micro-batch's input is cut into Spark tasks by our Python data sources.

Every task of a Python data source costs a Python worker round trip, and bronze's Delta sink
writes one file per task. At live rates a batch holds a few thousand rows spread over every
Kafka partition (or every file of the upstream commits), so one task per partition or file
makes the fixed cost, not the rows, set the batch time (and the small-file count). Small
batches are therefore packed into fewer tasks; big catch-up batches keep one task per item.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def coalesce(items: list[T], sizes: list[int], rows_per_task: int) -> list[list[T]]:
    """Pack ``items`` (with row counts ``sizes``) into ``ceil(total / rows_per_task)`` groups
    (at most one per item), largest first into the lightest group; each group keeps the items'
    original order. ``rows_per_task`` <= 0 keeps one group per item."""
    if rows_per_task <= 0 or len(items) <= 1:
        return [[i] for i in items]
    total = sum(max(s, 0) for s in sizes)
    n = max(1, min(len(items), -(-total // rows_per_task)))
    if n == len(items):
        return [[i] for i in items]
    groups: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for idx in sorted(range(len(items)), key=lambda i: -sizes[i]):
        k = load.index(min(load))
        groups[k].append(idx)
        load[k] += max(sizes[idx], 0)
    return [[items[i] for i in sorted(g)] for g in groups if g]
