"""Benchmark 5, throughput vs cap: one fixed workload (many concurrent
prompts, fixed prompt and output lengths, greedy, ``ignore_eos``) at a sweep
of caps; output tokens/s, preemptions and queueing per cap, as a table and a
PNG plot.

    .venv/bin/python benchmarks/bench_throughput.py [--device cpu|cuda] [--model PATH]
        [--caps 2M 4M 8M 12M 16M 24M] [--num-prompts 64] [--prompt-len 64]
        [--output-len 128] [--repeats 3]

All requests are submitted at once to ``LLM.generate``. Preemptions are the
increase of vLLM's ``vllm:num_preemptions`` counter over the timed run (from
``LLM.get_metrics()``, ``disable_log_stats=False``), cross-checked with the
per-request ``num_preemptions`` of each output's metrics. Queueing is each
request's time from queued to first scheduled (``RequestOutput.metrics``:
``scheduled_ts - queued_ts``), mean and max. Throughput is also given as a
ratio to the largest cap of the same run.
"""

from __future__ import annotations

import argparse
import statistics

import _common as c

DEFAULT_CAPS = ["2M", "4M", "8M", "12M", "16M", "24M"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.add_common_args(parser)
    parser.add_argument("--caps", nargs="+", default=DEFAULT_CAPS)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median reported)")
    parser.add_argument(
        "--cycles",
        type=int,
        default=1,
        help="sweeps, alternating descending and ascending order; median per cap over all timed runs (default 1)",
    )
    args = parser.parse_args()

    from vllm_kv_cache_limit.logic.sizes import parse_size

    max_model_len = args.prompt_len + args.output_len
    workload = {
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
    }
    caps = sorted(((text, parse_size(text)) for text in args.caps), key=lambda x: x[1])
    runs_by_cap: dict[str, list[dict]] = {text: [] for text, _ in caps}
    results: dict[str, dict] = {}
    for cycle in range(args.cycles):
        # Largest cap first (the reference the others are compared to), then
        # the smallest up; the next cycle runs the other way round.
        order = [caps[-1]] + caps[:-1] if cycle % 2 == 0 else caps[::-1]
        for text, cap in order:
            spec = c.base_engine_args(
                args,
                max_model_len=max_model_len,
                kv_cache_max_memory=cap,
                disable_log_stats=False,
                max_num_seqs=max(args.num_prompts, 1),
                max_num_batched_tokens=max(args.num_prompts * args.prompt_len, max_model_len),
                workload=workload,
            )
            run = c.run_engine(spec, c.bench_env(), log_name=f"throughput-{text}-{cycle}")
            c.check_ok(run, f"engine with cap {text}")
            results[text] = run.result
            runs_by_cap[text] += run.result["workload"]["runs"]
            tps = statistics.median(r["output_tokens_per_s"] for r in run.result["workload"]["runs"])
            print(
                f"cycle {cycle} cap {text}: {tps:.0f} tok/s, "
                f"{run.result['workload']['runs'][0]['preemptions']} preemptions",
                flush=True,
            )

    rows = []
    for text, cap in caps:
        res, runs = results[text], runs_by_cap[text]
        blocks = res["num_gpu_blocks"]
        block_tokens = res["block_size"]
        blocks_per_request = -(-max_model_len // block_tokens)

        def med(key: str, runs: list = runs) -> float | None:
            values = [r[key] for r in runs if r[key] is not None]
            return statistics.median(values) if values else None

        tps = [r["output_tokens_per_s"] for r in runs]
        rows.append(
            {
                "cap": text,
                "cap_bytes": cap,
                "cap_mib": c.mib(cap),
                "kv_bytes": res["kv_cache_bytes"][0],
                "blocks": blocks,
                "block_bytes": res["kv_cache_bytes"][0] // blocks,
                "blocks_per_request": blocks_per_request,
                # vLLM keeps one block back (the null block).
                "max_concurrent": min(args.num_prompts, (blocks - 1) // blocks_per_request),
                "output_tokens": runs[0]["output_tokens"],
                "timed_runs": len(runs),
                "seconds": med("seconds"),
                "tokens_per_s": med("output_tokens_per_s"),
                "tokens_per_s_min": min(tps),
                "tokens_per_s_max": max(tps),
                "tokens_per_cpu_s": med("output_tokens_per_cpu_s"),
                "preemptions": med("preemptions"),
                "preemptions_from_requests": med("preemptions_from_requests"),
                "preempted_requests": med("preempted_requests"),
                "queue_s_mean": med("queue_s_mean"),
                "queue_s_max": med("queue_s_max"),
                "runs": runs,
            }
        )

    rows.sort(key=lambda r: r["cap_bytes"])
    reference = rows[-1]["tokens_per_s"]
    for row in rows:
        row["tokens_per_s_ratio"] = row["tokens_per_s"] / reference
        row["tps_range"] = f"{row['tokens_per_s_min']:.0f}-{row['tokens_per_s_max']:.0f}"
    c.print_table(
        rows,
        [
            ("cap", "cap"),
            ("blocks", "blocks"),
            ("max_concurrent", "max concurrent"),
            ("tokens_per_s", "output tok/s"),
            ("tps_range", "min-max tok/s"),
            ("tokens_per_s_ratio", "ratio to largest"),
            ("seconds", "seconds"),
            ("preemptions", "preemptions"),
            ("preempted_requests", "preempted reqs"),
            ("queue_s_mean", "queue mean s"),
            ("queue_s_max", "queue max s"),
        ],
        digits=2,
    )
    plot_path = c.RESULTS_DIR / "throughput_vs_cap.png"
    plot(rows, workload, plot_path, args.num_prompts)
    csv_path, _ = c.save(
        "throughput",
        rows,
        {"workload": workload, "max_model_len": max_model_len, "plot": str(plot_path.relative_to(c.REPO))},
    )
    print(f"\nwrote {csv_path} and {plot_path}")


def plot(rows: list[dict], workload: dict, path, num_prompts: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = [r["cap_mib"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
    top.plot(caps, [r["tokens_per_s"] for r in rows], "o-", color="tab:blue")
    if all("tokens_per_s_min" in r for r in rows):
        top.fill_between(
            caps,
            [r["tokens_per_s_min"] for r in rows],
            [r["tokens_per_s_max"] for r in rows],
            color="tab:blue",
            alpha=0.15,
        )
    top.set_ylabel("output tokens/s", color="tab:blue")
    top.set_ylim(bottom=0)
    twin = top.twinx()
    twin.plot(caps, [r["preemptions"] or 0 for r in rows], "s--", color="tab:red")
    twin.set_ylabel("preemptions", color="tab:red")
    twin.set_ylim(bottom=0)
    top.set_title(
        f"Throughput vs kv_cache_max_memory\n{workload['num_prompts']} prompts, "
        f"{workload['prompt_len']} in / {workload['output_len']} out tokens, greedy",
        fontsize=10,
    )
    top.grid(alpha=0.3)
    # The smallest cap at which every request fits at once (plus the null block).
    fit_blocks = num_prompts * rows[0]["blocks_per_request"] + 1
    fit_mib = fit_blocks * rows[0]["block_bytes"] / 2**20
    for axis in (top, bottom):
        axis.axvline(fit_mib, color="grey", linestyle=":", linewidth=1)
    top.annotate(
        f"all {num_prompts} requests fit\n({fit_blocks} blocks)",
        (fit_mib, 0),
        textcoords="offset points",
        xytext=(4, 8),
        fontsize=7,
        color="grey",
    )
    bottom.plot(caps, [r["queue_s_mean"] for r in rows], "o-", color="tab:green", label="mean")
    bottom.plot(caps, [r["queue_s_max"] for r in rows], "^--", color="tab:olive", label="max")
    bottom.set_ylabel("queue time per request (s)")
    bottom.set_xlabel("kv_cache_max_memory (MiB)")
    bottom.set_ylim(bottom=0)
    bottom.legend()
    bottom.grid(alpha=0.3)
    for r in rows:
        bottom.annotate(
            f"{r['blocks']} blk",
            (r["cap_mib"], r["queue_s_max"] or 0),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=7,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
