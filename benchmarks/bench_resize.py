"""Benchmark 7, run-time resize: one OpenAI server with a 48M cap under
steady load is shrunk to 16M and grown back, first in drain mode, then in
preempt mode. Samples generated tokens/s and running requests over time (a
plot), and times how long each shrink takes to hold.

    .venv/bin/python benchmarks/bench_resize.py [--phase-s 25] [--clients 40]

Reports, from one run side by side: tokens/s and running requests in each
phase as a ratio of the first 48M phase, and the seconds from the POST to
the limit holding in each mode. Failed requests are counted (expected 0).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import _common as c
import requests

from tests.helpers import CompletionLoad, api_servers, metric

ROUTE = "/kv_cache/max_memory"
PROMPT = "the quick brown fox jumps over the lazy dog " * 96
MAX_TOKENS = 1000
# (phase name, size set at its start, mode)
PHASES = [
    ("48M", None, None),
    ("16M drain", "16M", "drain"),
    ("48M again", "48M", "drain"),
    ("16M preempt", "16M", "preempt"),
    ("48M at the end", "48M", "drain"),
]


def sample(base: str, t0: float, rows: list[dict], stop: threading.Event, period: float) -> None:
    last = None
    while not stop.is_set():
        now = time.monotonic()
        tokens = metric(base, "vllm:generation_tokens_total")
        status = requests.get(base + ROUTE, timeout=60).json()
        row = {
            "t_s": round(now - t0, 2),
            "running": metric(base, "vllm:num_requests_running"),
            "waiting": metric(base, "vllm:num_requests_waiting"),
            "blocks_limit": status["num_blocks_limit"],
            "blocks_in_use": status["num_blocks_in_use"],
            "tokens_per_s": None if last is None else (tokens - last[1]) / (now - last[0]),
        }
        rows.append(row)
        last = (now, tokens)
        stop.wait(period)


def plot(rows: list[dict], events: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 7.5), sharex=True)
    t = [r["t_s"] for r in rows]
    top.plot(t, [r["tokens_per_s"] for r in rows], color="tab:blue")
    top.set_ylabel("generated tokens/s")
    middle.plot(t, [r["running"] for r in rows], color="tab:green", label="running")
    middle.plot(t, [r["waiting"] for r in rows], color="tab:gray", label="waiting")
    middle.set_ylabel("requests")
    middle.legend(loc="upper right")
    bottom.plot(t, [r["blocks_limit"] for r in rows], color="tab:red", label="block limit")
    bottom.plot(t, [r["blocks_in_use"] for r in rows], color="tab:purple", label="blocks in use")
    bottom.set_ylabel("KV cache blocks")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper right")
    for event in events:
        for axis in (top, middle, bottom):
            axis.axvline(event["t_s"], color="black", linestyle=":", linewidth=0.8)
        top.annotate(event["phase"], (event["t_s"], 0), xytext=(2, 2), textcoords="offset points", fontsize=7)
    fig.suptitle("Resize under load: 48M -> 16M -> 48M (drain), then the same with preempt")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.add_common_args(parser)
    parser.add_argument("--phase-s", type=float, default=25.0, help="seconds per phase (default 25)")
    parser.add_argument("--clients", type=int, default=40, help="concurrent clients (default 40)")
    args = parser.parse_args()
    model = c.model_path(args)
    server_args = [
        "--model",
        model,
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "64",
        "--enforce-eager",
        "--kv-cache-max-memory",
        "48M",
        "--enable-kv-cache-resize",
    ]
    rows: list[dict] = []
    events: list[dict] = []
    with tempfile.TemporaryDirectory() as folder, api_servers({"s": (server_args, c.bench_env())}, Path(folder)) as up:
        server = up["s"]
        if server.ready_s is None:
            raise SystemExit(f"server did not start:\n{server.log_path.read_text()[-3000:]}")
        base = server.base
        stop = threading.Event()
        t0 = time.monotonic()
        with CompletionLoad(base, args.clients, PROMPT, MAX_TOKENS) as load:
            sampler = threading.Thread(target=sample, args=(base, t0, rows, stop, 0.5), daemon=True)
            sampler.start()
            for name, size, mode in PHASES:
                event = {"phase": name, "t_s": round(time.monotonic() - t0, 2)}
                if size is not None:
                    started = time.monotonic()
                    reply = requests.post(
                        base + ROUTE, json={"size": size, "mode": mode, "timeout_s": 120}, timeout=300
                    )
                    reply.raise_for_status()
                    event.update(hold_s=round(time.monotonic() - started, 3), holds=reply.json()["holds"], mode=mode)
                events.append(event)
                time.sleep(args.phase_s)
            stop.set()
            sampler.join()
        failures, completed = len(load.failures), load.completed

    summary = []
    for i, event in enumerate(events):
        end = events[i + 1]["t_s"] if i + 1 < len(events) else rows[-1]["t_s"]
        # The phase's second half: after the change has settled.
        inside = [r for r in rows if (event["t_s"] + end) / 2 <= r["t_s"] < end and r["tokens_per_s"] is not None]
        summary.append(
            {
                "phase": event["phase"],
                "hold_s": event.get("hold_s"),
                "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in inside) if inside else None,
                "running": statistics.mean(r["running"] for r in inside) if inside else None,
            }
        )
    first = summary[0]
    for row in summary:
        row["tokens_per_s_ratio"] = row["tokens_per_s"] / first["tokens_per_s"] if first["tokens_per_s"] else None
        row["running_ratio"] = row["running"] / first["running"] if first["running"] else None
    png = c.RESULTS_DIR / "resize.png"
    c.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot(rows, events, png)
    c.save(
        "resize",
        rows,
        {"events": events, "summary": summary, "failed_requests": failures, "completed_requests": completed},
    )
    print(
        c.table(
            summary,
            [
                ("phase", "phase"),
                ("hold_s", "s to hold"),
                ("tokens_per_s", "tokens/s"),
                ("tokens_per_s_ratio", "tokens/s vs 48M"),
                ("running", "running"),
                ("running_ratio", "running vs 48M"),
            ],
        )
    )
    print(f"completed requests {completed}, failed {failures}; plot: {png}")


if __name__ == "__main__":
    main()
