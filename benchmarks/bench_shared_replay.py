"""Benchmark 8i, a shared budget under real traffic: two OpenAI servers on
one host replay the Azure LLM inference traces 2023, once under an even
split of a KV budget (a static cap of half of it each) and once under the
shared budget (both autoscaled, each capped at the whole budget,
``--kv-cache-shared-budget``), one pair after the other in one run.

The traces are the Azure LLM inference traces 2023 (Patel et al.,
"Splitwise: Efficient generative LLM inference using phase splitting",
ISCA 2024; Azure/AzurePublicDataset, CC-BY 4.0), read from
``--trace-dir`` (default ``../shared/data/azure-llm-2023`` beside the
repository). The conversation trace goes to server ``conv``, the code
trace to server ``code``: minutes ``--start-min`` to ``--start-min +
--minutes`` of each (from its own first request), arrivals ``--speed``
times faster, the prompt ``ContextTokens / --prompt-div`` tokens (at most
``--prompt-cap``, random token ids, so no prefix is shared), ``max_tokens``
``GeneratedTokens / --gen-div`` (at least 1, at most ``--gen-cap``),
``ignore_eos``, streamed.

Per variant and server: TTFT p50/p90/p99 (the first streamed chunk),
TPOT p50 (the time between the first and last chunk per further token),
goodput (requests per second of replay that met ``--ttft-slo`` and
``--tpot-slo``), and the limit and the waiting requests over time (the
status route polled every ``--sample-s``). Writes
``benchmarks/results/<name>.csv/.json``, ``<name>_samples.csv`` and
``<name>.png`` (both servers' limits over time, per variant).

    python benchmarks/bench_shared_replay.py [--minutes 6] [--speed 2] [--budget 8M]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _common as c
import requests

from tests.helpers import api_servers

ROUTE = "/kv_cache/max_memory"
SERVERS = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}
EVEN, SHARED = "even split", "shared budget"
VOCAB = 500
"""Token ids drawn for the prompts (the tiny Llama's vocabulary is 503)."""


def load_trace(path: Path, args: argparse.Namespace) -> list[tuple[float, int, int]]:
    """(seconds after the replay starts, prompt tokens, max_tokens) per request of the window."""
    rows = []
    with path.open() as handle:
        for row in csv.DictReader(handle):
            stamp = datetime.datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
            rows.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    first = min(r[0] for r in rows)
    start, end = args.start_min * 60, (args.start_min + args.minutes) * 60
    out = []
    for stamp, context, generated in rows:
        at = (stamp - first).total_seconds()
        if start <= at < end:
            prompt = max(1, min(args.prompt_cap, context // args.prompt_div))
            out.append(((at - start) / args.speed, prompt, max(1, min(args.gen_cap, generated // args.gen_div))))
    return sorted(out)


def one_request(base: str, prompt: int, max_tokens: int, seed: int) -> dict[str, Any]:
    """A streamed completion; its TTFT, TPOT and tokens, or its failure."""
    rng = random.Random(seed)
    body = {
        "model": "tiny",
        "prompt": [rng.randrange(3, VOCAB) for _ in range(prompt)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    first = last_at = None
    last = b""
    try:
        with requests.post(f"{base}/v1/completions", json=body, timeout=3600, stream=True) as reply:
            if reply.status_code != 200:
                return {"error": f"{reply.status_code}: {reply.text[:200]}"}
            for line in reply.iter_lines():
                if not line.startswith(b"data: ") or line[6:] == b"[DONE]":
                    continue
                now = time.monotonic()
                if json.loads(line[6:]).get("choices"):
                    first = now if first is None else first
                    last_at = now
                last = line[6:]
    except Exception as exc:
        return {"error": repr(exc)}
    tokens = int(((json.loads(last) if last else {}).get("usage") or {}).get("completion_tokens") or 0)
    if first is None or not tokens:
        return {"error": f"stream ended with {last[:200]!r}"}
    tpot = (last_at - first) / (tokens - 1) if tokens > 1 and last_at is not None else 0.0
    return {"ttft": first - started, "tpot": tpot, "tokens": tokens}


def replay(base: str, trace: list[tuple[float, int, int]], t0: float, results: list[dict[str, Any]]) -> None:
    """Send each request of ``trace`` at its time after ``t0``, each in a thread of its own."""
    threads = []
    for index, (at, prompt, max_tokens) in enumerate(trace):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)

        def run(i: int = index, p: int = prompt, m: int = max_tokens) -> None:
            results.append({"index": i, **one_request(base, p, m, i)})

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()


class Sampler(threading.Thread):
    """Polls each server's status route every ``period`` s: limit and waiting requests."""

    def __init__(self, variant: str, bases: dict[str, str], period: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.variant, self.bases, self.period, self.t0 = variant, bases, period, t0
        self.samples: list[dict[str, Any]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period):
            for server, base in self.bases.items():
                try:
                    found = requests.get(base + ROUTE, timeout=10).json()
                except (requests.RequestException, ValueError):
                    continue
                self.samples.append(
                    {
                        "variant": self.variant,
                        "server": server,
                        "t_s": round(time.monotonic() - self.t0, 2),
                        "limit_blocks": found.get("num_blocks_limit"),
                        "limit_mib": c.mib(found.get("kv_cache_limit_bytes")),
                        "in_use_blocks": found.get("num_blocks_in_use"),
                        "waiting": found.get("num_requests_waiting"),
                        "running": found.get("num_requests_running"),
                    }
                )


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    data = sorted(values)
    return data[min(len(data) - 1, max(0, round(q / 100 * len(data) + 0.5) - 1))]


def preemptions(base: str) -> int | None:
    """vLLM's own count of the requests it preempted (``vllm:num_preemptions_total`` on its /metrics)."""
    try:
        text = requests.get(base + "/metrics", timeout=10).text
    except requests.RequestException:
        return None
    counts = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_preemptions_total")
    ]
    return int(sum(counts)) if counts else None


def autoscale_changes(base: str) -> int | None:
    """The autoscaler's own count of its limit changes (``autoscale.changes`` on the status route)."""
    try:
        found = requests.get(base + ROUTE, timeout=10).json()
    except (requests.RequestException, ValueError):
        return None
    changes = (found.get("autoscale") or {}).get("changes") if isinstance(found, dict) else None
    return changes if isinstance(changes, int) else None


def limit_changes(samples: list[dict], server: str) -> int:
    """How often the sampled limit of ``server`` moved."""
    limits = [s["limit_blocks"] for s in samples if s["server"] == server and s["limit_blocks"] is not None]
    return sum(1 for a, b in zip(limits, limits[1:]) if a != b)


def summarize(
    variant: str, server: str, results: list[dict], samples: list[dict], span: float, args: Any, preempted: int | None
) -> dict:
    done = [r for r in results if "ttft" in r]
    ttft = [r["ttft"] for r in done]
    good = [r for r in done if r["ttft"] <= args.ttft_slo and r["tpot"] <= args.tpot_slo]
    limits = [s["limit_blocks"] for s in samples if s["server"] == server and s["limit_blocks"] is not None]
    waiting = [s["waiting"] for s in samples if s["server"] == server and s["waiting"] is not None]
    return {
        "variant": variant,
        "server": server,
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_ms": 1000 * statistics.median(r["tpot"] for r in done) if done else None,
        "goodput_per_s": len(good) / span,
        "output_tokens_per_s": sum(r["tokens"] for r in done) / span,
        "requests_per_s": len(done) / span,
        "span_s": span,
        "limit_min_blocks": min(limits, default=None),
        "limit_median_blocks": statistics.median(limits) if limits else None,
        "limit_max_blocks": max(limits, default=None),
        "waiting_max": max(waiting, default=None),
        "limit_changes": limit_changes(samples, server),
        "preemptions": preempted,
    }


def server_args(args: argparse.Namespace, model: str, *extra: str) -> list[str]:
    return [
        *("--model", model, "--served-model-name", "tiny", "--max-model-len", str(args.max_model_len)),
        *("--max-num-seqs", str(args.max_num_seqs), "--dtype", args.dtype, "--enforce-eager", "--seed", "0"),
        *extra,
    ]


def binding(args: argparse.Namespace, server: str) -> tuple[dict[str, str], list[str]]:
    """A server's CPUs: its environment and the command it starts under.
    vLLM's CPU backend binds each engine's worker to the first CPU it does
    not reserve (``auto``), so two servers on one host both compute on CPU 0
    and wait for each other there. ``split`` gives
    each worker its own CPU (``VLLM_CPU_OMP_THREADS_BIND``), as vLLM's CPU
    docs advise for several instances on one host, but leaves the rest of
    each server free to run anywhere: an engine core busy-waits for its
    worker's output (vLLM's shared-memory queue yields in a loop for a
    second after each read), and a busy server's engine core took 115 s of
    the other server's CPU in 180 s, an amount that changes from run to
    run. ``own`` runs each server's whole process tree on a CPU of its own
    (``taskset``): the engine core's loop then yields to its own worker
    (it took 23 s there), and neither server computes on the other's CPU,
    as two models on separate GPUs would not."""
    bind = getattr(args, "bind", "auto")
    if bind == "auto":  # callers that give no --bind keep vLLM's
        return {}, []
    cpus = sorted(os.sched_getaffinity(0))
    cpu = str(cpus[list(SERVERS).index(server) % len(cpus)])
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpu}
    if bind == "split":
        return env, []
    return env, ["taskset", "-c", cpu]


def run_variant(variant: str, args: argparse.Namespace, model: str, traces: dict, locks: Path) -> tuple[list, list]:
    """Start the variant's two servers, replay both traces at once, stop them."""
    from vllm_kv_cache_limit.logic.sizes import format_size, parse_size

    budget = parse_size(args.budget)
    if variant == EVEN:  # the route is served with resize enabled; nothing resizes
        extra: tuple[str, ...] = ("--kv-cache-max-memory", format_size(budget // 2), "--enable-kv-cache-resize")
    else:
        extra = ("--kv-cache-max-memory", args.budget, "--kv-cache-autoscale", "--kv-cache-shared-budget", args.budget)
    env = {"VLLM_KV_CACHE_LIMIT_LOCK_DIR": str(locks / variant.replace(" ", "-"))}
    if args.shrink_after_s is not None:
        env["VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S"] = f"{args.shrink_after_s:g}"
    tag = variant.replace(" ", "-")
    launch: dict[str, Any] = {}
    for s in SERVERS:
        bind_env, launcher = binding(args, s)
        launch[f"{args.name}-{tag}-{s}"] = (
            server_args(args, model, *extra),
            c.bench_env(True, **env, **bind_env),
            launcher,
        )
    with api_servers(launch, c.RESULTS_DIR, c.ENGINE_TIMEOUT_S, c.REPO) as up:
        bases = {}
        for name, server in up.items():
            if server.ready_s is None:
                raise SystemExit(f"{name} did not start: see {server.log_path}")
            bases[name.rsplit("-", 1)[1]] = server.base
        t0 = time.monotonic() + 1.0
        sampler = Sampler(variant, bases, args.sample_s, t0)
        sampler.start()
        results: dict[str, list[dict[str, Any]]] = {s: [] for s in SERVERS}
        threads = [threading.Thread(target=replay, args=(bases[s], traces[s], t0, results[s])) for s in SERVERS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        span = max(args.minutes * 60 / args.speed, time.monotonic() - t0)
        sampler.done.set()
        sampler.join()
        preempted = {s: preemptions(bases[s]) for s in SERVERS}
        changes = {s: autoscale_changes(bases[s]) for s in SERVERS}
    rows = [summarize(variant, s, results[s], sampler.samples, span, args, preempted[s]) for s in SERVERS]
    for row in rows:
        row["limit_changes_counted"] = changes[row["server"]]
    for row in rows:
        print(
            f"{variant} {row['server']}: TTFT p50/p90/p99 {c.fmt(row['ttft_p50_s'])}/{c.fmt(row['ttft_p90_s'])}/"
            f"{c.fmt(row['ttft_p99_s'])} s, goodput {c.fmt(row['goodput_per_s'])}/s, limit blocks "
            f"{row['limit_min_blocks']}/{row['limit_median_blocks']}/{row['limit_max_blocks']}, waiting max "
            f"{row['waiting_max']}, {row['limit_changes']} limit changes sampled, {row['preemptions']} preempted, "
            f"{row['failed']} failed",
            flush=True,
        )
    return rows, sampler.samples


def plot(samples: list[dict[str, Any]], path: Path, budget_blocks: dict[str, int | None]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [EVEN, SHARED]
    fig, axes = plt.subplots(len(variants), 1, figsize=(9, 6), sharex=True, sharey=True)
    for ax, variant in zip(axes, variants):
        for server, colour, style in (("conv", "tab:blue", "-"), ("code", "tab:orange", "--")):
            mine = [s for s in samples if s["variant"] == variant and s["server"] == server]
            ax.step(
                [s["t_s"] for s in mine],
                [s["limit_blocks"] for s in mine],
                where="post",
                color=colour,
                linestyle=style,
                label=server,
            )
        if budget_blocks.get(variant):
            ax.axhline(budget_blocks[variant], color="red", linestyle="--", linewidth=1, label="budget (blocks)")
        ax.set_title(variant, fontsize=9)
        ax.set_ylabel("limit (blocks)")
        ax.legend(fontsize=8, loc="upper right")
    axes[-1].set_xlabel("seconds of replay")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # api_servers' cleanup stops the servers


def add_replay_args(parser: argparse.ArgumentParser, start_min: float, minutes: float, speed: float, bind: str) -> None:
    """The options of a replay (the traces, the requests, the servers, the
    goodput's SLOs, the sampling, the CPUs), with these defaults; also
    benchmark 11's."""
    parser.add_argument("--trace-dir", type=Path, default=c.REPO.parent / "shared" / "data" / "azure-llm-2023")
    parser.add_argument(
        "--start-min", type=float, default=start_min, help=f"first minute of each trace (default {start_min:g})"
    )
    parser.add_argument(
        "--minutes", type=float, default=minutes, help=f"minutes of trace replayed (default {minutes:g})"
    )
    parser.add_argument(
        "--speed", type=float, default=speed, help=f"arrivals this many times faster (default {speed:g})"
    )
    parser.add_argument("--prompt-div", type=int, default=8, help="prompt = ContextTokens / this (default 8)")
    parser.add_argument("--prompt-cap", type=int, default=400, help="at most this many prompt tokens (default 400)")
    parser.add_argument("--gen-div", type=int, default=2, help="max_tokens = GeneratedTokens / this (default 2)")
    parser.add_argument("--gen-cap", type=int, default=96, help="at most this max_tokens (default 96)")
    parser.add_argument("--budget", default="8M", help="the KV budget of the pair (default 8M)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ttft-slo", type=float, default=1.0, help="goodput: TTFT at most (s, default 1)")
    parser.add_argument("--tpot-slo", type=float, default=0.1, help="goodput: TPOT at most (s, default 0.1)")
    parser.add_argument("--sample-s", type=float, default=0.5, help="status polled every (s, default 0.5)")
    parser.add_argument("--shrink-after-s", type=float, default=None, help="the hysteresis (default: the plugin's)")
    parser.add_argument(
        "--bind",
        choices=["own", "split", "auto"],
        default=bind,
        help=(
            "own: each server's processes on a CPU of its own; split: each server's worker on a CPU of its own, "
            f"the rest anywhere; auto: vLLM's binding, both workers on one CPU (default {bind})"
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_common_args(parser)
    add_replay_args(parser, start_min=8.0, minutes=6.0, speed=2.0, bind="own")
    parser.add_argument("--variants", nargs="+", choices=[EVEN, SHARED], default=[EVEN, SHARED])
    parser.add_argument("--name", default="shared_replay")
    args = parser.parse_args()
    model = c.model_path(args)
    signal.signal(signal.SIGTERM, _terminate)
    c.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    traces = {server: load_trace(args.trace_dir / name, args) for server, name in SERVERS.items()}
    print(", ".join(f"{s}: {len(t)} requests" for s, t in traces.items()), flush=True)
    rows: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        for variant in args.variants:
            found, sampled = run_variant(variant, args, model, traces, Path(tmp))
            rows += found
            samples += sampled
    columns = [("variant", "variant"), ("server", "server"), ("completed", "done"), ("failed", "failed")]
    columns += [(f"ttft_{p}_s", f"TTFT {p} s") for p in ("p50", "p90", "p99")]
    columns += [("tpot_p50_ms", "TPOT p50 ms"), ("goodput_per_s", "goodput /s")]
    columns += [(f"limit_{k}_blocks", f"limit {k}") for k in ("min", "median", "max")]
    columns += [("waiting_max", "waiting max"), ("limit_changes", "limit changes"), ("preemptions", "preempted")]
    c.print_table(rows, columns)
    samples_path = c.RESULTS_DIR / f"{args.name}_samples.csv"
    with samples_path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(samples[0]) if samples else ["variant"])
        writer.writeheader()
        writer.writerows(samples)
    even_blocks = max((s["limit_blocks"] or 0 for s in samples if s["variant"] == EVEN), default=0)
    plot(samples, c.RESULTS_DIR / f"{args.name}.png", {SHARED: 2 * even_blocks or None})
    trace_note = "Azure LLM inference traces 2023 (Patel et al., ISCA 2024; Azure/AzurePublicDataset), CC-BY 4.0"
    csv_path, json_path = c.save(args.name, rows, {"settings": vars(args), "traces": trace_note})
    print(f"\nresults: {csv_path}, {json_path}, {samples_path}, {c.RESULTS_DIR / (args.name + '.png')}")


if __name__ == "__main__":
    main()
