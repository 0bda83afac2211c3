"""Benchmark 9, chunk size of a VMM-backed KV cache: what a resize step
costs in driver calls, bytes moved and time when the KV cache's physical
memory is mapped in chunks of 2, 8, 32 or 128 MiB, over the host-memory
stand-in for vLLM 0.34's VMM driver (``tests/cuda_wheel/vmm_standin.py``).

    .venv-cuda-0.34.0/bin/python benchmarks/bench_vmm_chunks.py [--step-mib 256]
        [--chunks-mib 2,8,32,128] [--repeats 5]

(Any Python 3.10+ runs it: the stand-in needs the standard library only.)

Per chunk size, one reservation of twice the step, the first step committed
untimed, then ``--repeats`` times, the chunk sizes alternating within each
repetition:

- grow by the step: ``create`` + ``map`` per chunk, then one ``set_access``
  over the grown range (vLLM grants access per contiguous run);
- shrink by the step: ``unmap`` + ``release`` per chunk above the new size,
  whole chunks only (CUDA cannot unmap part of a mapping).

Each chunk size runs twice: with the chunk's host pages allocated at
``create`` (``fallocate``, as ``cuMemCreate`` allocates device memory),
and with pages never allocated, which leaves the cost of the calls and the
stand-in's bookkeeping alone.

Reports the calls per step, the bytes mapped or unmapped, and the step's
median time with its quartiles. These are host-memory figures: ``create``
allocates the memfd's pages (``fallocate``), ``map`` is an ``mmap`` of it,
``set_access`` an ``mprotect``, ``unmap`` an ``mmap(PROT_NONE)`` over it and
``release`` closes the memfd (the kernel frees its pages). They measure the
bookkeeping and the number of calls; the driver's own cost per call on a
GPU is what ``scripts/vmm_driver_check.py`` measures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common as c

from tests.cuda_wheel.vmm_standin import HostVmmDriver, MiB

GRANULARITY = 2 * MiB
"""CUDA's minimum VMM granularity on current NVIDIA GPUs."""


def grow(driver: HostVmmDriver, base: int, start: int, step: int, chunk: int) -> list[int]:
    """Map ``step`` bytes at ``base + start`` in chunks; the handles, in order."""
    handles = []
    for offset in range(start, start + step, chunk):
        handle = driver.create(chunk, 0)
        driver.map(base + offset, chunk, handle)
        handles.append(handle)
    driver.set_access(base + start, step, 0)
    return handles


def shrink(driver: HostVmmDriver, base: int, start: int, chunk: int, handles: list[int]) -> None:
    """Unmap and release the chunks mapped at ``base + start`` onwards."""
    for i, handle in enumerate(handles):
        driver.unmap(base + start + i * chunk, chunk)
        driver.release(handle)


class Setup:
    """One chunk size: its driver, reservation and the committed first step."""

    def __init__(self, chunk: int, step: int, populate: bool) -> None:
        self.chunk, self.step, self.populate = chunk, step, populate
        self.driver = HostVmmDriver(GRANULARITY, populate=populate)
        self.base = self.driver.reserve(2 * step)
        self.first = grow(self.driver, self.base, 0, step, chunk)
        self.samples: dict[str, list[float]] = {"grow": [], "shrink": []}
        self.calls: dict[str, dict[str, int]] = {}
        self.moved: dict[str, int] = {}

    def once(self) -> None:
        d = self.driver
        calls, mapped = dict(d.calls), d.bytes_mapped_total
        t0 = time.perf_counter()
        handles = grow(d, self.base, self.step, self.step, self.chunk)
        t1 = time.perf_counter()
        self.samples["grow"].append(t1 - t0)
        self.calls["grow"] = {k: v - calls.get(k, 0) for k, v in d.calls.items() if v != calls.get(k, 0)}
        self.moved["grow"] = d.bytes_mapped_total - mapped
        assert d.mapped_bytes == 2 * self.step

        calls, unmapped = dict(d.calls), d.bytes_unmapped_total
        t0 = time.perf_counter()
        shrink(d, self.base, self.step, self.chunk, handles)
        t1 = time.perf_counter()
        self.samples["shrink"].append(t1 - t0)
        self.calls["shrink"] = {k: v - calls.get(k, 0) for k, v in d.calls.items() if v != calls.get(k, 0)}
        self.moved["shrink"] = d.bytes_unmapped_total - unmapped
        assert d.mapped_bytes == d.physical_bytes == self.step

    def close(self) -> None:
        self.driver.close()

    def rows(self) -> list[dict]:
        rows = []
        for kind in ("grow", "shrink"):
            times = self.samples[kind]
            q = c.spread(times)
            n_chunks = self.step // self.chunk
            rows.append(
                {
                    "pages": "at create" if self.populate else "never touched",
                    "chunk_mib": self.chunk // MiB,
                    "step": f"{kind} {self.step // MiB} MiB",
                    "chunks": n_chunks,
                    "calls": " + ".join(f"{v} {k}" for k, v in sorted(self.calls[kind].items())),
                    "num_calls": sum(self.calls[kind].values()),
                    "moved_mib": self.moved[kind] / MiB,
                    "ms_median": 1e3 * q["median"],
                    "ms_q1": 1e3 * q["q1"],
                    "ms_q3": 1e3 * q["q3"],
                    "ms_per_chunk": 1e3 * statistics.median(times) / n_chunks,
                    "repeats": len(times),
                }
            )
        return rows


COLUMNS = [
    ("pages", "host pages allocated"),
    ("chunk_mib", "chunk MiB"),
    ("step", "step"),
    ("chunks", "chunks"),
    ("calls", "driver calls"),
    ("moved_mib", "MiB moved"),
    ("ms_median", "ms / step (median)"),
    ("ms_q1", "q1"),
    ("ms_q3", "q3"),
    ("ms_per_chunk", "ms / chunk"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-mib", type=int, default=256, help="grow and shrink by this much (default 256)")
    parser.add_argument("--chunks-mib", default="2,8,32,128", help="chunk sizes in MiB, multiples of 2")
    parser.add_argument("--repeats", type=int, default=5, help="timed grow/shrink pairs per chunk size")
    parser.add_argument("--no-save", action="store_true", help="print the table only")
    args = parser.parse_args()

    step = args.step_mib * MiB
    chunks = [int(x) * MiB for x in args.chunks_mib.split(",")]
    for chunk in chunks:
        if chunk % GRANULARITY or step % chunk:
            raise SystemExit(f"chunk {chunk // MiB} MiB must be a multiple of 2 MiB dividing the step")
    setups = [Setup(chunk, step, populate) for populate in (True, False) for chunk in chunks]
    try:
        for _ in range(args.repeats):
            for setup in setups:
                setup.once()
        rows = [row for setup in setups for row in setup.rows()]
    finally:
        for setup in setups:
            setup.close()
    print(
        f"Host-memory stand-in, granularity {GRANULARITY // MiB} MiB, step {args.step_mib} MiB, {args.repeats} repeats"
    )
    c.print_table(rows, COLUMNS, digits=3)
    if not args.no_save:
        meta = {"step_mib": args.step_mib, "repeats": args.repeats, "granularity_mib": GRANULARITY // MiB}
        csv_path, json_path = c.save("vmm_chunks", rows, meta)
        print(f"\n{csv_path}\n{json_path}")


if __name__ == "__main__":
    main()
