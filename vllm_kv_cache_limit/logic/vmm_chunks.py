"""Where a VMM-backed KV cache (vLLM 0.34's extensible KV cache) is cut into
physical chunks, so that the chunks wholly above a run-time limit can be
unmapped and released while every block below it keeps its memory.

The driver can unmap only a whole mapping, and vLLM maps each contiguous
run it commits as one chunk. Cutting every run at whole-block boundaries of
each segment (the same block count in every segment) makes "the blocks at
or above ``keep``" a set of whole chunks. Pure arithmetic, no vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MiB = 1 << 20

TARGET_CHUNK_BYTES = 8 * MiB
"""About how much of one segment a chunk maps: the driver's granularity
(2 MiB on CUDA) rounded to whole blocks, times what comes closest to this
without exceeding it (at least once). Smaller chunks return memory in finer
steps, larger ones take fewer driver calls per resize
(``benchmarks/RESULTS.md`` section 9)."""


@dataclass(frozen=True)
class ChunkPlan:
    """The chunk grid of one KV cache: segment ``i`` starts at byte
    ``segment_offsets[i]`` of the reservation, holds ``capacity_blocks``
    blocks of ``segment_strides[i]`` bytes, and is cut every
    ``blocks_per_chunk`` blocks."""

    segment_offsets: tuple[int, ...]
    segment_strides: tuple[int, ...]
    capacity_blocks: int
    blocks_per_chunk: int
    granularity: int

    def cuts(self, start: int, end: int) -> list[int]:
        """The chunk boundaries strictly inside ``[start, end)`` (bytes of
        the reservation), ascending: segment starts and every
        ``blocks_per_chunk`` blocks within a segment."""
        found: set[int] = set()
        for offset, stride in zip(self.segment_offsets, self.segment_strides):
            step = self.blocks_per_chunk * stride
            if start < offset < end:
                found.add(offset)
            first = max(1, -(-(start - offset) // step))
            cut = offset + first * step
            segment_end = offset + self.capacity_blocks * stride
            while cut < min(end, segment_end):
                if cut > start:
                    found.add(cut)
                cut += step
        return sorted(found)

    def pieces(self, start: int, size: int) -> list[tuple[int, int]]:
        """``(offset, size)`` of the chunks one run ``[start, start+size)``
        is mapped as."""
        bounds = [start, *self.cuts(start, start + size), start + size]
        return [(a, b - a) for a, b in zip(bounds, bounds[1:])]

    def kept(self, keep: int) -> list[tuple[int, int]]:
        """The byte ranges of blocks ``[0, keep)``, one per segment."""
        return [(offset, offset + keep * stride) for offset, stride in zip(self.segment_offsets, self.segment_strides)]

    def releasable(self, chunks: list[tuple[int, int]], keep: int) -> list[tuple[int, int]]:
        """Of the mapped ``(offset, size)`` chunks, those that hold no byte of
        a block below ``keep``: they can go whole."""
        kept = self.kept(keep)
        return [
            (offset, size)
            for offset, size in chunks
            if all(offset + size <= lo or offset >= hi for lo, hi in kept if hi > lo)
        ]

    def chunk_bytes(self) -> int:
        """Bytes of one chunk over all segments (one step of the memory returned)."""
        return self.blocks_per_chunk * sum(self.segment_strides)


def plan_chunks(
    segment_offsets: list[int],
    segment_strides: list[int],
    capacity_blocks: int,
    granularity: int,
    target_bytes: int = TARGET_CHUNK_BYTES,
) -> ChunkPlan | str:
    """The chunk grid for a KV cache's segments, or why it cannot have one
    (a segment that does not start on the driver's granularity)."""
    if granularity <= 0 or not segment_strides or capacity_blocks <= 0 or any(s <= 0 for s in segment_strides):
        return f"the KV cache has no segments to cut (granularity {granularity}, strides {segment_strides})"
    unaligned = [offset for offset in segment_offsets if offset % granularity]
    if unaligned:
        return (
            f"its segments do not start on the driver's granularity of {granularity} bytes "
            f"(segment offsets {unaligned[:3]})"
        )
    # The fewest blocks that make a whole number of granules in every segment.
    least = 1
    for stride in segment_strides:
        least = math.lcm(least, granularity // math.gcd(granularity, stride))
    widest = least * max(segment_strides)
    blocks_per_chunk = least * max(1, target_bytes // widest)
    return ChunkPlan(tuple(segment_offsets), tuple(segment_strides), capacity_blocks, blocks_per_chunk, granularity)
