"""Benchmark 8h, the cost of a burst after idling: CPU seconds and page
faults per process of an autoscaled server whose burst starts from the
floor, against a server with a static cap, and of a burst that finds the
autoscaled limit grown (no idle before it).

Three OpenAI servers (tiny fp32 Llama, ``--max-model-len 512``,
``--kv-cache-max-memory 48M``), started at once and then loaded one at a
time, in an order that rotates every round:

- ``autoscaled``: ``--kv-cache-autoscale``; a shrink after idling returns the
  pages above the limit lazily (``MADV_FREE``, the default);
- ``autoscaled-at-once``: the same with ``VLLM_KV_CACHE_LIMIT_LAZY_RELEASE=0``
  (``MADV_DONTNEED``: the release before lazy release existed);
- ``static``: the cap alone.

``VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S`` is 3 s. Each run is ``--cycles``
cycles of: ``--idle-s`` seconds idle (then, autoscaled, until the limit is
at its floor and its pages returned), a burst of ``--clients`` streamed
requests at once (``from-floor``), then at once a second burst
(``grown``: the limit the first one grew is still in force). Prompts of
about ``--prompt-tokens`` tokens, ``max_tokens`` ``--max-tokens`` (vLLM
trims it to the context: about 68 tokens each), ``ignore_eos``.

Around each burst, ``/proc/<pid>/stat`` of the engine core, each worker and
the API server: user and system CPU seconds and minor page faults (CPU
seconds and fault counts hold on a shared machine, where wall clock does
not). Per run and kind of burst: the sums over the cycles, CPU per
generated token, TTFT (the first streamed chunk; with ``--no-stream``,
each request's latency). Per round, the ratios to
the static server of the same round; the summary gives their median, min
and max. Default run: 6 rounds, 2 cycles (about 10 min on the 2-core
machine of RESULTS.md, start-up included). ``--fresh-servers`` starts the
three servers again for every round, so that no server process's own state
(its allocator's, say) weighs on every round of its variant.

    python benchmarks/bench_burst.py [--rounds 6] [--cycles 2] [--fresh-servers]
        [--dtype float32] [--no-stream]
"""

from __future__ import annotations

import argparse
import json
import os
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
WORDS = "the quick brown fox jumps over the lazy dog "
TOKENS_PER_WORDS = 9
AUTO, AT_ONCE, STATIC = "autoscaled", "autoscaled-at-once", "static"
VARIANTS = (AUTO, AT_ONCE, STATIC)
KINDS = ("from-floor", "grown")
WAIT_S = 120.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
PROCESSES = ("engine_core", "worker", "api_server")


def status(base: str) -> dict[str, Any]:
    reply = requests.get(base + ROUTE, timeout=60)
    reply.raise_for_status()
    return reply.json()


def wait_for(condition: Any, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")


# ---------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------


def processes(pid: int) -> dict[str, list[int]]:
    """The server's pids by role: its engine core, its workers (vLLM titles
    them ``VLLM::EngineCore`` and ``VLLM::Worker...``) and itself."""
    import psutil

    found: dict[str, list[int]] = {"engine_core": [], "worker": [], "api_server": [pid]}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            title = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        if "::Worker" in title:
            found["worker"].append(child.pid)
        elif "::EngineCore" in title:
            found["engine_core"].append(child.pid)
    if not found["worker"]:  # the worker runs in the engine core's process
        found["worker"] = list(found["engine_core"])
    return found


def stat(pid: int) -> dict[str, float]:
    """User and system CPU seconds and minor faults of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return {"user_s": int(fields[11]) / CLK_TCK, "system_s": int(fields[12]) / CLK_TCK, "minor_faults": int(fields[7])}


def stats(pids: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """:func:`stat` summed per role."""
    out = {}
    for role, members in pids.items():
        total = {"user_s": 0.0, "system_s": 0.0, "minor_faults": 0.0}
        for pid in members:
            for key, value in stat(pid).items():
                total[key] += value
        out[role] = total
    return out


def held(pids: list[int]) -> tuple[int, int]:
    """RSS and RSS less LazyFree (``smaps_rollup``) summed over ``pids``."""
    from vllm_kv_cache_limit.logic.kv_cache import held_bytes, smaps_field_kib

    rss = kept = 0
    for pid in pids:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        rss += smaps_field_kib(text, "Rss") * 1024
        kept += held_bytes(text)
    return rss, kept


# ---------------------------------------------------------------------------
# Bursts
# ---------------------------------------------------------------------------


def burst(
    base: str, clients: int, prompt: str, max_tokens: int, first: int, stream: bool = True
) -> tuple[list[float], int, list[str]]:
    """``clients`` completions sent at once, each a prompt of its own (no
    prefix shared); their TTFTs (streamed) or latencies (``stream=False``),
    the tokens generated, failures."""
    ttft: list[float] = []
    tokens = [0]
    failures: list[str] = []
    lock = threading.Lock()
    gate = threading.Barrier(clients)

    def one(index: int) -> None:
        body = {
            "model": "tiny",
            "prompt": f"{first + index} {prompt}",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        gate.wait()
        started = time.monotonic()
        seen: float | None = None
        last = b""
        try:
            if not stream:
                reply = requests.post(f"{base}/v1/completions", json=body, timeout=600)
                if reply.status_code != 200:
                    raise RuntimeError(f"{reply.status_code}: {reply.text[:300]}")
                done = int((reply.json().get("usage") or {}).get("completion_tokens") or 0)
                with lock:
                    if done:
                        ttft.append(time.monotonic() - started)
                        tokens[0] += done
                    else:
                        failures.append(f"no tokens in {reply.text[:200]!r}")
                return
            with requests.post(f"{base}/v1/completions", json=body, timeout=600, stream=True) as reply:
                if reply.status_code != 200:
                    raise RuntimeError(f"{reply.status_code}: {reply.text[:300]}")
                for line in reply.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    if line[6:] == b"[DONE]":
                        break
                    if seen is None:
                        seen = time.monotonic() - started
                    last = line[6:]
            usage = (json.loads(last) if last else {}).get("usage") or {}
            with lock:
                if seen is None or not usage.get("completion_tokens"):
                    failures.append(f"stream ended with {last[:200]!r}")
                else:
                    ttft.append(seen)
                    tokens[0] += int(usage["completion_tokens"])
        except Exception as exc:
            with lock:
                failures.append(repr(exc))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return ttft, tokens[0], failures


def at_floor(base: str, floor: int) -> bool:
    found = status(base)
    return found["kv_cache_limit_bytes"] == floor and bool(found.get("holds"))


def run_variant(
    variant: str, base: str, pids: dict[str, list[int]], floor: int | None, args: argparse.Namespace, counter: list[int]
) -> list[dict[str, Any]]:
    """``--cycles`` cycles of idle, a burst from the floor, a burst at the
    grown limit; one row per kind of burst, summed over the cycles."""
    prompt = WORDS * max(1, round(args.prompt_tokens / TOKENS_PER_WORDS))
    from vllm_kv_cache_limit.logic.sizes import parse_size

    cap = parse_size(args.cap)
    sums: dict[str, dict[str, Any]] = {
        kind: {"tokens": 0, "ttft": [], "failed": 0, "limit_at_start": [], "held_at_start": [], "rss_at_start": []}
        for kind in KINDS
    }
    for _ in range(args.cycles):
        time.sleep(args.idle_s)
        if floor is not None:
            wait_for(lambda: at_floor(base, floor), f"{variant} at its floor, its pages returned")
        for kind in KINDS:
            row = sums[kind]
            row["limit_at_start"].append(status(base)["kv_cache_limit_bytes"] if floor is not None else cap)
            rss, kept = held(pids["worker"])
            row["rss_at_start"].append(rss)
            row["held_at_start"].append(kept)
            before = stats(pids)
            ttft, tokens, failures = burst(base, args.clients, prompt, args.max_tokens, counter[0], not args.no_stream)
            after = stats(pids)
            counter[0] += args.clients
            for role in PROCESSES:
                for key in ("user_s", "system_s", "minor_faults"):
                    name = f"{role}_{key}"
                    row[name] = row.get(name, 0.0) + after[role][key] - before[role][key]
            row["tokens"] += tokens
            row["ttft"] += ttft
            row["failed"] += len(failures)
            if failures:
                print(f"  {variant} {kind}: {len(failures)} failed, e.g. {failures[0]}", flush=True)
    rows = []
    for kind, row in sums.items():
        tokens = row["tokens"] or 1
        worker_s = row["worker_user_s"] + row["worker_system_s"]
        server_s = sum(row[f"{role}_user_s"] + row[f"{role}_system_s"] for role in PROCESSES)
        ttft = sorted(row.pop("ttft"))
        rows.append(
            {
                "variant": variant,
                "kind": kind,
                **row,
                "requests": len(ttft),
                "worker_cpu_s": worker_s,
                "worker_ms_per_token": 1000 * worker_s / tokens,
                "engine_core_ms_per_token": 1000 * (row["engine_core_user_s"] + row["engine_core_system_s"]) / tokens,
                "server_ms_per_token": 1000 * server_s / tokens,
                "worker_faults_per_token": row["worker_minor_faults"] / tokens,
                "ttft_p50_s": statistics.median(ttft) if ttft else None,
                "ttft_max_s": ttft[-1] if ttft else None,
                "limit_at_start_min_mib": c.mib(min(row["limit_at_start"])),
                "worker_rss_at_start_mib": c.mib(statistics.median(row["rss_at_start"])),
                "worker_held_at_start_mib": c.mib(statistics.median(row["held_at_start"])),
            }
        )
    return rows


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------

RATIOS = {
    "worker CPU per token": "worker_ms_per_token",
    "worker user CPU": "worker_user_s",
    "worker system CPU": "worker_system_s",
    "worker minor faults": "worker_minor_faults",
    "engine core CPU per token": "engine_core_ms_per_token",
    "server CPU per token": "server_ms_per_token",
    "TTFT p50": "ttft_p50_s",
}


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round, kind and autoscaled variant: its figures over the static
    server's of the same round."""
    out = []
    index = {(r["round"], r["variant"], r["kind"]): r for r in rows}
    for (rnd, variant, kind), row in index.items():
        static = index.get((rnd, STATIC, kind))
        if variant == STATIC or static is None:
            continue
        entry: dict[str, Any] = {"round": rnd, "variant": variant, "kind": kind}
        for label, key in RATIOS.items():
            a, b = row.get(key), static.get(key)
            entry[label] = a / b if a is not None and b else None
        out.append(entry)
    return out


def summarize(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for variant in (AUTO, AT_ONCE):
        for kind in KINDS:
            mine = [r for r in found if r["variant"] == variant and r["kind"] == kind]
            for label in RATIOS:
                values = [r[label] for r in mine if r[label] is not None]
                if values:
                    s = c.spread(values)
                    out.append(
                        {
                            "variant": variant,
                            "kind": kind,
                            "ratio to static": label,
                            **{k: s[k] for k in ("n", "median", "min", "max")},
                        }
                    )
    return out


def per_process(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant and kind, the median over rounds of each process's figures."""
    out = []
    keys = [
        "engine_core_user_s",
        "engine_core_system_s",
        "worker_user_s",
        "worker_system_s",
        "worker_minor_faults",
        "api_server_user_s",
        "api_server_system_s",
        "tokens",
        "worker_ms_per_token",
        "server_ms_per_token",
        "ttft_p50_s",
        "worker_rss_at_start_mib",
        "worker_held_at_start_mib",
    ]
    for kind in KINDS:
        for variant in VARIANTS:
            mine = [r for r in rows if r["variant"] == variant and r["kind"] == kind]
            if mine:
                out.append(
                    {"kind": kind, "variant": variant, **{k: statistics.median(r[k] for r in mine) for k in keys}}
                )
    return out


def server_args(args: argparse.Namespace, model: str, *extra: str) -> list[str]:
    out = [
        "--model",
        model,
        "--served-model-name",
        "tiny",
        "--max-model-len",
        str(args.max_model_len),
        "--enforce-eager",
        "--seed",
        "0",
        "--kv-cache-max-memory",
        args.cap,
        *extra,
    ]
    if args.gpu_memory_utilization is not None:
        out += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.dtype is not None:
        out += ["--dtype", args.dtype]
    return out


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # api_servers' cleanup stops the servers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_common_args(parser)
    parser.add_argument("--rounds", type=int, default=6, help="rounds, each one run of every variant (default 6)")
    parser.add_argument("--cycles", type=int, default=2, help="idle + two bursts per run (default 2)")
    parser.add_argument("--clients", type=int, default=32, help="requests per burst (default 32)")
    parser.add_argument("--idle-s", type=float, default=6.0, help="idle before each cycle (default 6)")
    parser.add_argument("--shrink-after-s", type=float, default=3.0, help="the servers' hysteresis (default 3)")
    parser.add_argument("--prompt-tokens", type=int, default=440, help="default 440")
    parser.add_argument("--max-tokens", type=int, default=200, help="default 200 (trimmed to the context)")
    parser.add_argument("--max-model-len", type=int, default=512, help="default 512")
    parser.add_argument("--cap", default="48M", help="--kv-cache-max-memory (default 48M)")
    parser.add_argument("--name", default="burst", help="results name (default burst)")
    parser.add_argument(
        "--dtype",
        default=None,
        help="the servers' --dtype, and so the KV cache's (default: vLLM's; the tiny model's float32 weights run "
        "in bfloat16 on the CPU backend, float32 doubles the KV cache's bytes per token)",
    )
    parser.add_argument(
        "--no-stream",
        action="store_true",
        help="plain (not streamed) completions; the TTFT columns then hold each request's whole latency",
    )
    parser.add_argument(
        "--fresh-servers",
        action="store_true",
        help="start the three servers again for every round (no allocator state carried between rounds)",
    )
    args = parser.parse_args()
    model = c.model_path(args)
    signal.signal(signal.SIGTERM, _terminate)
    c.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-burst-") as tmp:
        common = {
            "VLLM_KV_CACHE_LIMIT_LOCK_DIR": str(Path(tmp) / "locks"),
            "VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S": f"{args.shrink_after_s:g}",
        }
        launch: dict[str, Any] = {
            f"{args.name}-{AUTO}": (server_args(args, model, "--kv-cache-autoscale"), c.bench_env(**common)),
            f"{args.name}-{AT_ONCE}": (
                server_args(args, model, "--kv-cache-autoscale"),
                c.bench_env(**common, VLLM_KV_CACHE_LIMIT_LAZY_RELEASE="0"),
            ),
            f"{args.name}-{STATIC}": (server_args(args, model), c.bench_env(**common)),
        }
        print(f"starting {len(launch)} servers ...", flush=True)
        counter = [0]
        # One set of servers for the whole run, or (--fresh-servers) a new one every round.
        batches = [[rnd] for rnd in range(args.rounds)] if args.fresh_servers else [list(range(args.rounds))]
        for rounds in batches:
            with api_servers(launch, c.RESULTS_DIR, c.ENGINE_TIMEOUT_S, c.REPO) as up:
                servers = {name.removeprefix(f"{args.name}-"): server for name, server in up.items()}
                for name, server in servers.items():
                    if server.ready_s is None:
                        raise SystemExit(f"{name} did not start: see {server.log_path}")
                pids = {name: processes(server.pid) for name, server in servers.items() if server.pid}
                # The static server serves no limit route: its limit is the cap.
                floors = {
                    name: None if name == STATIC else status(server.base)["autoscale"]["floor_bytes"]
                    for name, server in servers.items()
                }
                for server in servers.values():  # each server's first load, not measured
                    burst(server.base, args.clients, WORDS * 10, 16, 10**6 + counter[0])
                    counter[0] += args.clients
                for rnd in rounds:
                    order = VARIANTS[rnd % 3 :] + VARIANTS[: rnd % 3]
                    for variant in order:
                        server = servers[variant]
                        for row in run_variant(variant, server.base, pids[variant], floors[variant], args, counter):
                            rows.append({"round": rnd, **row, "load_avg_1m": round(os.getloadavg()[0], 2)})
                            print(
                                f"round {rnd} {variant} {row['kind']}: worker {c.fmt(row['worker_ms_per_token'])} "
                                f"ms/token, {row['worker_minor_faults']:.0f} faults, TTFT p50 "
                                f"{c.fmt(row['ttft_p50_s'])} s, {row['tokens']} tokens, {row['failed']} failed",
                                flush=True,
                            )
        print("servers stopped", flush=True)
    found = ratios(rows)
    summary = summarize(found)
    table = per_process(rows)
    columns_pp = [
        ("kind", "burst"),
        ("variant", "variant"),
        ("engine_core_user_s", "engine core user s"),
        ("engine_core_system_s", "engine core sys s"),
        ("worker_user_s", "worker user s"),
        ("worker_system_s", "worker sys s"),
        ("worker_minor_faults", "worker minor faults"),
        ("api_server_user_s", "API server user s"),
        ("tokens", "tokens"),
        ("worker_ms_per_token", "worker ms/token"),
        ("server_ms_per_token", "server ms/token"),
        ("ttft_p50_s", "TTFT p50 s"),
        ("worker_rss_at_start_mib", "worker RSS at start MiB"),
        ("worker_held_at_start_mib", "RSS less LazyFree MiB"),
    ]
    columns_sum = [
        ("variant", "variant"),
        ("kind", "burst"),
        ("ratio to static", "ratio to static"),
        ("n", "pairs"),
        ("median", "median"),
        ("min", "min"),
        ("max", "max"),
    ]
    c.print_table(table, columns_pp)
    c.print_table(summary, columns_sum)
    csv_path, json_path = c.save(
        args.name, rows, {"summary": summary, "per_process": table, "ratios": found, "settings": vars(args)}
    )
    print(f"\nresults: {csv_path}, {json_path}; server logs: {c.RESULTS_DIR}/{args.name}-*.log")


if __name__ == "__main__":
    main()
