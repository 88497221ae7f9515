"""Decommitted page ranges: pure arithmetic on sorted, disjoint ``(start, end)`` address spans.

Under a policy that decommits (``PoolPolicy.decommit``) the pool gives the pages of
large free ranges inside a segment back to the device while keeping the segment
(what PyTorch's expandable segments do by unmapping).  Each segment keeps the ranges
it gave back as a sorted list of disjoint, page-aligned ``(start, end)`` spans of
absolute addresses; these functions compute on such lists and never touch memory.
"""

from __future__ import annotations

import bisect

Span = tuple[int, int]  # [start, end) in absolute addresses


def page_interior(start: int, end: int, page: int) -> Span | None:
    """The whole pages inside [start, end): (first page start, last page end), or None
    when not one whole page fits (a partial page is shared with a neighbouring block)."""
    first = -(-start // page) * page
    last = end // page * page
    return (first, last) if last > first else None


def span_bytes(spans: list[Span]) -> int:
    return sum(end - start for start, end in spans)


def uncovered(spans: list[Span], start: int, end: int) -> list[Span]:
    """The parts of [start, end) that no span of ``spans`` covers, by address."""
    gaps: list[Span] = []
    cursor = start
    index = max(bisect.bisect_right(spans, (start, start)) - 1, 0)
    for span_start, span_end in spans[index:]:
        if span_start >= end:
            break
        if span_end <= cursor:
            continue
        if span_start > cursor:
            gaps.append((cursor, span_start))
        cursor = max(cursor, span_end)
    if cursor < end:
        gaps.append((cursor, end))
    return gaps


def add_spans(spans: list[Span], added: list[Span]) -> list[Span]:
    """``spans`` with the (disjoint, uncovered) ``added`` ones, touching spans joined."""
    merged: list[Span] = []
    for start, end in sorted([*spans, *added]):
        if merged and merged[-1][1] >= start:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def remove_range(spans: list[Span], start: int, end: int) -> tuple[list[Span], int]:
    """``spans`` less [start, end) (a block allocated over them), and the bytes removed."""
    kept: list[Span] = []
    removed = 0
    for span_start, span_end in spans:
        if span_end <= start or span_start >= end:
            kept.append((span_start, span_end))
            continue
        removed += min(span_end, end) - max(span_start, start)
        if span_start < start:
            kept.append((span_start, start))
        if span_end > end:
            kept.append((end, span_end))
    return kept, removed


def spans_within(spans: list[Span], start: int, end: int) -> int:
    """Bytes of ``spans`` inside [start, end)."""
    return sum(max(0, min(e, end) - max(s, start)) for s, e in spans)
