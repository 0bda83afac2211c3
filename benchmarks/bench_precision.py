"""Benchmark 1, precision of the cap: KV cache bytes the workers allocate
(summed over the storages of the KV cache tensors, measured inside the
worker) against ``kv_cache_max_memory``, from a few blocks to many.

    .venv/bin/python benchmarks/bench_precision.py [--device cpu|cuda] [--model PATH]
        [--caps 3blk-1 1000000 101blk-1 100M 1G] [--max-model-len 128]

Caps are sizes (``16M``, ``1000000``) or block multiples (``101blk-1`` is one
byte less than 101 blocks: the worst case for the >= 0.99 target). Targets:
never over the cap, less than one block under it, and allocated/cap >= 0.99
once the cap holds 100 blocks or more. ``max_model_len`` is small so that a
cap of two blocks still starts (vLLM keeps one block back as its null block).
"""

from __future__ import annotations

import argparse

import _common as c

DEFAULT_CAPS = ["3blk-1", "1000000", "101blk-1", "100M", "1G"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.add_common_args(parser)
    parser.add_argument("--caps", nargs="+", default=DEFAULT_CAPS)
    parser.add_argument("--max-model-len", type=int, default=128)
    args = parser.parse_args()

    model = c.model_path(args)
    assumed_block = c.block_bytes_estimate(args, model)
    caps = [(text, c.parse_cap(text, assumed_block)) for text in args.caps]
    rows = []
    for text, cap in caps:
        spec = c.base_engine_args(args, max_model_len=args.max_model_len, kv_cache_max_memory=cap)
        run = c.run_engine(spec, c.bench_env(), log_name=f"precision-{cap}")
        c.check_ok(run, f"engine with cap {text}")
        res = run.result
        blocks = res["num_gpu_blocks"]
        for rank, allocated in enumerate(res["kv_cache_bytes"]):
            block_bytes = allocated // blocks
            cap_blocks = cap / block_bytes
            whole = int(cap_blocks) * block_bytes
            rows.append(
                {
                    "cap": text,
                    "cap_bytes": cap,
                    "worker": rank,
                    "cap_blocks": cap_blocks,
                    "cap_in_blocks": f"{cap_blocks:.6f}",
                    "allocated_bytes": allocated,
                    "blocks": blocks,
                    "block_bytes": block_bytes,
                    "alloc_over_cap": allocated / cap,
                    "alloc_over_whole_blocks": allocated / whole if whole else None,
                    "under_cap_bytes": cap - allocated,
                    "never_over": allocated <= cap,
                    "within_one_block": 0 <= cap - allocated < block_bytes,
                    "ratio_target": (allocated / cap >= 0.99) if cap_blocks >= 100 else None,
                    "startup_s": res["startup_s"],
                }
            )
        print(f"cap {text}: {allocated} bytes in {blocks} blocks", flush=True)
        if "blk" in text and block_bytes != assumed_block:
            print(
                f"warning: caps in blocks assumed {assumed_block}-byte blocks; the engine "
                f"uses {block_bytes}-byte blocks, so {text!r} is not what it says",
                flush=True,
            )

    c.print_table(
        rows,
        [
            ("cap", "cap"),
            ("cap_bytes", "cap bytes"),
            ("cap_in_blocks", "cap/block"),
            ("allocated_bytes", "allocated bytes"),
            ("blocks", "blocks"),
            ("alloc_over_cap", "alloc/cap"),
            ("alloc_over_whole_blocks", "alloc/whole blocks"),
            ("under_cap_bytes", "under cap by"),
            ("never_over", "<= cap"),
            ("within_one_block", "< 1 block under"),
            ("ratio_target", ">= 0.99 (>=100 blk)"),
        ],
        digits=4,
    )
    summary = {
        "assumed_block_bytes": assumed_block,
        "never_over": all(r["never_over"] for r in rows),
        "within_one_block": all(r["within_one_block"] for r in rows),
        "ratio_target_met": all(r["ratio_target"] for r in rows if r["ratio_target"] is not None),
        "max_model_len": args.max_model_len,
    }
    csv_path, _ = c.save("precision", rows, {"summary": summary})
    print(
        f"\nnever over the cap: {summary['never_over']}; within one block: "
        f"{summary['within_one_block']}; >= 0.99 from 100 blocks: "
        f"{summary['ratio_target_met']}\nwrote {csv_path}"
    )


if __name__ == "__main__":
    main()
