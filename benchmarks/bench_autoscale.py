"""Benchmark 8, autoscaled KV cache limits and a shared budget per device.

    .venv/bin/python benchmarks/bench_autoscale.py [--parts bursts budget] [--pairs 2] [--cycles 2]

Six OpenAI servers, started at once (tiny Llama, max_model_len 2048,
max-num-seqs 64; 128-token blocks of 128 KiB on the CPU backend, about
1 KiB of KV cache per token):

- ``burst-auto``: ``--kv-cache-max-memory 32M --kv-cache-autoscale``
- ``burst-static``: ``--kv-cache-max-memory 32M --enable-kv-cache-resize``
  (the route only to read the limit; it never changes)
- ``budget-a``, ``budget-b``: ``--kv-cache-max-memory 32M --kv-cache-autoscale
  --kv-cache-shared-budget 32M`` (either could take the whole budget)
- ``half-a``, ``half-b``: ``--kv-cache-max-memory 16M --enable-kv-cache-resize``

All share one fresh temporary lock folder (``VLLM_KV_CACHE_LIMIT_LOCK_DIR``),
so the benchmark never joins another run's start-up lock or budget ledger.
``VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S`` is 5 s here (``--shrink-after-s``;
the plugin's default is 30 s), so that an idle autoscaled server shrinks
within the benchmark's short idle periods. Every server is stopped at the
end, process groups included, also on errors.

Three measurements, each a ratio of two variants of this one run:

1. Idle footprint: worker RSS (psutil, the server's ``VLLM::Worker``
   process) and resident KV cache bytes (``mincore``, through
   ``/collective_rpc`` and ``tests.helpers.KVCacheProbe``) of
   ``burst-auto`` / ``burst-static``, both idle and running at the same
   time, after the same bursts (measurement 2's) and once the autoscaled one
   has shrunk to its floor. Also read right after start-up.
2. Bursty load on one server: streamed completions (time to the first
   chunk), bursts of 16 concurrent clients for 10 s, then 8 s idle, twice per
   run; ``burst-auto`` and ``burst-static`` alternate (A B B A ...). Output
   tokens/s over the bursts and p99 time to first token, each pair's ratio
   autoscaled / static and the spread between repeats of one variant. Aim:
   within 5 % (tokens/s ratio >= 0.95, p99 TTFT ratio <= 1.05).
3. Two servers, alternating load, one budget S = 32M: A busy while B idles
   for 25 s, then B busy while A idles, two cycles, the shared-budget pair
   and the static half split alternating per cycle. 16 clients of about 1440
   prompt and 256 generated tokens (14 blocks each at the end: a peak KV
   demand of 28 MiB, about 0.9 S, more than a half split's 16M holds). The
   busy server's output tokens/s, shared budget / static half split. Aim:
   1.5x or more. The sum of the shared pair's limits is sampled every 0.5 s
   and plotted with the budget and each server's limit
   (``results/autoscale.png``).

Default run: about 10 minutes on the shared 2-core machine of RESULTS.md
(start-up of the six servers at once 1.5-3 min, measurement 2 about 3 min,
measurement 1 under 30 s, measurement 3 about 3.5 min). Bigger runs:
``--pairs 4 --bursts 3 --cycles 4 --phase-s 60``; with the plugin's own
hysteresis, ``--shrink-after-s 30 --idle-s 40``.

Writes ``results/autoscale.{csv,json}`` (one row per reading, run and
phase; the summary in the JSON), ``results/autoscale_samples.{csv,json}``
(the time series), ``results/autoscale.png`` and the servers' logs
``results/autoscale-*.log``. Failed requests are counted (expected 0).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import random
import re
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import _common as c
import requests

from tests.helpers import CompletionLoad, Periodic, Server, api_servers, ledger_holds

ROUTE = "/kv_cache/max_memory"
WORDS = "the quick brown fox jumps over the lazy dog "
TOKENS_PER_WORDS = 9
"""Tokens of one ``WORDS`` with the tiny Llama's tokenizer (96 are 867 tokens);
the prompt lengths reported are the servers' own counts."""

BURST_AUTO, BURST_STATIC = "burst-auto", "burst-static"
BUDGET_A, BUDGET_B = "budget-a", "budget-b"
HALF_A, HALF_B = "half-a", "half-b"
BURST_VARIANTS = {"autoscaled": BURST_AUTO, "static": BURST_STATIC}
SHARED, HALVES = "shared budget", "static half split"
BUDGET_VARIANTS = {SHARED: (BUDGET_A, BUDGET_B), HALVES: (HALF_A, HALF_B)}

METRICS = {
    "tokens": "vllm:generation_tokens_total",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "preemptions": "vllm:num_preemptions_total",
}
COLORS = {
    BURST_AUTO: "tab:blue",
    BURST_STATIC: "tab:gray",
    BUDGET_A: "tab:blue",
    BUDGET_B: "tab:orange",
    HALF_A: "tab:cyan",
    HALF_B: "tab:olive",
}
SPAN_COLORS = {"autoscaled": "tab:blue", "static": "tab:gray", SHARED: "tab:green", HALVES: "tab:gray"}
WAIT_S = 180.0
"""The longest wait for an autoscaled limit to reach its floor."""


# ---------------------------------------------------------------------------
# Talking to the servers
# ---------------------------------------------------------------------------


def status(base: str) -> dict[str, Any]:
    """``GET /kv_cache/max_memory``: the limit in force and its blocks."""
    reply = requests.get(base + ROUTE, timeout=60)
    reply.raise_for_status()
    return reply.json()


def metrics(base: str) -> dict[str, float | None]:
    """``METRICS`` from one scrape of ``/metrics`` (each summed over its label sets)."""
    text = requests.get(base + "/metrics", timeout=60).text
    found: dict[str, float | None] = {}
    for key, name in METRICS.items():
        values = [float(m[1]) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
        found[key] = sum(values) if values else None
    return found


def rpc_sum(base: str, method: str) -> int | None:
    """A ``KVCacheProbe`` method through ``POST /collective_rpc``, summed over
    the workers; None where a worker could not read it."""
    try:
        reply = requests.post(base + "/collective_rpc", json={"method": method}, timeout=60)
        results = reply.json()["results"] if reply.ok else None
    except (requests.RequestException, ValueError, KeyError):
        return None
    if not results or any(r is None for r in results):
        return None
    return sum(int(r) for r in results)


def complete(base: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    reply = requests.post(base + "/v1/completions", json=body, timeout=300)
    reply.raise_for_status()
    return reply.json()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> float:
    """Seconds until ``condition()`` held; RuntimeError after ``timeout``."""
    started = time.monotonic()
    while time.monotonic() < started + timeout:
        if condition():
            return time.monotonic() - started
        time.sleep(0.25)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")


def at_limit(base: str, nbytes: int) -> Callable[[], bool]:
    """For :func:`wait_for`: whether the server's limit is ``nbytes``."""
    return lambda: status(base)["kv_cache_limit_bytes"] == nbytes


def _title(process: Any) -> str:
    import psutil

    try:
        return " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        return ""


def worker_processes(pid: int) -> list[Any]:
    """The server's worker processes (vLLM titles them ``VLLM::Worker...``;
    the CPU backend runs one per tensor-parallel rank under the engine core),
    else its engine core (a worker in the engine core's own process)."""
    import psutil

    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    for marker in ("::Worker", "::EngineCore"):
        found = [p for p in tree if marker in _title(p)]
        if found:
            return found
    return []


def cpu_and_faults(server: Server) -> dict[str, float] | None:
    """The server's workers' user and system CPU seconds and minor page
    faults so far (``/proc/PID/stat``), and its engine core's CPU seconds,
    to tell where a run's time went."""
    import psutil

    totals = {"user_s": 0.0, "system_s": 0.0, "minor_faults": 0.0, "engine_core_s": 0.0}
    try:
        tree = psutil.Process(server.pid).children(recursive=True) if server.pid else []
        for process in tree:
            if "::EngineCore" in _title(process):
                times = process.cpu_times()
                totals["engine_core_s"] += times.user + times.system
        for process in worker_processes(server.pid) if server.pid else []:
            times = process.cpu_times()
            totals["user_s"] += times.user
            totals["system_s"] += times.system
            fields = Path(f"/proc/{process.pid}/stat").read_text().rpartition(")")[2].split()
            totals["minor_faults"] += int(fields[7])  # minflt, the 10th field of stat
    except (psutil.Error, OSError, IndexError, ValueError):
        return None
    return totals


def _rss(processes: Iterable[Any]) -> int | None:
    import psutil

    total = 0
    try:
        for process in processes:
            total += process.memory_info().rss
    except psutil.Error:
        return None
    return total


def footprint(server: Server) -> dict[str, Any]:
    """Worker RSS, the whole tree's RSS, the KV cache's allocated and
    resident bytes and the limit of one server."""
    import psutil

    workers = worker_processes(server.pid) if server.pid else []
    try:
        top = psutil.Process(server.pid) if server.pid else None
        tree = [top, *top.children(recursive=True)] if top else []
    except psutil.Error:
        tree = []
    return {
        "workers": len(workers),
        "worker_rss_bytes": _rss(workers) if workers else None,
        "tree_rss_bytes": _rss(tree) if tree else None,
        "kv_bytes": rpc_sum(server.base, "kv_cache_bytes"),
        "kv_resident_bytes": rpc_sum(server.base, "kv_cache_resident_bytes"),
        "limit_bytes": status(server.base)["kv_cache_limit_bytes"],
    }


def steady_footprint(server: Server, readings: int = 3) -> dict[str, Any]:
    """The median of a few :func:`footprint` readings a second apart."""
    taken = []
    for i in range(readings):
        if i:
            time.sleep(1.0)
        taken.append(footprint(server))
    merged: dict[str, Any] = {}
    for key in taken[0]:
        values = [t[key] for t in taken if t[key] is not None]
        merged[key] = statistics.median(values) if values else None
    return merged


def ledger_sum(locks: Path) -> int | None:
    """The sum of the holds in the lock folder's budget ledger (None: no entry)."""
    return sum(ledger_holds(locks)) or None


# ---------------------------------------------------------------------------
# Load and sampling
# ---------------------------------------------------------------------------


class StreamingLoad(CompletionLoad):
    """``CompletionLoad`` with streamed completions (``"stream": true``):
    each reply also records the seconds from sending the request to its
    first chunk (``ttft_s``) and the tokens it generated (the final usage
    chunk; every request must generate exactly ``max_tokens``)."""

    def __init__(self, base: str, clients: int, prompt: str, max_tokens: int) -> None:
        super().__init__(base, clients, prompt, max_tokens)
        self.ttft_s: list[float] = []
        self.sent_s: list[float] = []
        """Per entry of ``ttft_s``: when its request was sent, seconds after the load began."""
        self.began = time.monotonic()
        self.tokens = 0

    def _client(self) -> None:
        session = requests.Session()
        while not self.stop.is_set():
            with self.lock:
                self.sent += 1
                prompt = f"{self.sent} {self.prompt}"
            body = {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": self.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            first: float | None = None
            problem: str | None = None
            started = time.monotonic()
            try:
                with session.post(f"{self.base}/v1/completions", json=body, timeout=600, stream=True) as reply:
                    if reply.status_code != 200:
                        problem = f"{reply.status_code}: {reply.text[:300]}"
                    else:
                        last = b""
                        for line in reply.iter_lines():
                            if not line.startswith(b"data: "):
                                continue
                            data = line[6:]
                            if data == b"[DONE]":
                                break
                            if first is None:
                                first = time.monotonic() - started
                            last = data
                        usage = (json.loads(last) if last else {}).get("usage") or {}
                        if first is None or usage.get("completion_tokens") != self.max_tokens:
                            problem = f"stream ended with {last[:300]!r}"
            except Exception as exc:
                problem = repr(exc)
            with self.lock:
                if problem or first is None:
                    self.failures.append(problem or "no chunk")
                else:
                    self.done.append(time.monotonic())
                    self.ttft_s.append(first)
                    self.sent_s.append(started - self.began)
                    self.tokens += self.max_tokens


class Sampler(Periodic):
    """Samples the servers' limits and metrics every ``period`` seconds in a
    thread, one row per server and tick. In each pair ``(a, b)`` the first
    server's limit is read again after the second's and the smaller reading
    kept, so that the pair's sum is not overstated by a change between the
    reads; with ``locks``, each pair row also holds the ledger's sum of holds."""

    def __init__(
        self,
        measurement: str,
        servers: dict[str, Server],
        period: float,
        pairs: tuple[tuple[str, str], ...] = (),
        locks: Path | None = None,
    ) -> None:
        super().__init__(period)
        self.measurement = measurement
        self.servers = servers
        self.pairs = pairs
        self.locks = locks
        self.rows: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.last: dict[str, tuple[float, float]] = {}
        self.ticks = 0

    def rel(self, moment: float) -> float:
        return round(moment - self.t0, 3)

    def sample(self) -> None:
        self._tick(self.ticks, self.last)
        self.ticks += 1

    def _tick(self, tick: int, last: dict[str, tuple[float, float]]) -> None:
        rows: dict[str, dict[str, Any]] = {}
        for name, server in self.servers.items():
            st = status(server.base)
            found = metrics(server.base)
            now = time.monotonic()
            row: dict[str, Any] = {
                "measurement": self.measurement,
                "tick": tick,
                "t_s": self.rel(now),
                "server": name,
                "limit_bytes": st["kv_cache_limit_bytes"],
                "held_bytes": (st.get("autoscale") or {}).get("held_bytes"),
                "blocks_in_use": st["num_blocks_in_use"],
                "bytes_per_block": st["bytes_per_block"],
                "running": found["running"],
                "waiting": found["waiting"],
                "preemptions": found["preemptions"],
                "tokens_per_s": None,
            }
            tokens = found["tokens"]
            if tokens is not None:
                if name in last:
                    then, before = last[name]
                    row["tokens_per_s"] = (tokens - before) / (now - then) if now > then else None
                last[name] = (now, tokens)
            rows[name] = row
        holds = ledger_sum(self.locks) if self.locks is not None else None
        for first, second in self.pairs:
            again = status(self.servers[first].base)["kv_cache_limit_bytes"]
            rows[first]["limit_bytes"] = min(rows[first]["limit_bytes"], again)
            for name in (first, second):
                rows[name]["ledger_holds_bytes"] = holds
        self.rows.extend(rows.values())

    def window(self, name: str, start: float, end: float) -> list[dict[str, Any]]:
        """This server's rows between two times relative to ``t0``."""
        return [r for r in self.rows if r["server"] == name and start <= r["t_s"] <= end]


# ---------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    data = sorted(values)
    if not data:
        return None
    k = (len(data) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def rel_spread(values: Iterable[float | None]) -> float | None:
    """(max - min) / median of the repeats of one variant."""
    data = [v for v in values if v is not None]
    if len(data) < 2:
        return None
    middle = statistics.median(data)
    return (max(data) - min(data)) / middle if middle else None


def mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.mean(values) if values else None


def median_of(values: Iterable[float | None]) -> float | None:
    data = [v for v in values if v is not None]
    return statistics.median(data) if data else None


def prompt_of(tokens: int) -> str:
    return WORDS * max(1, round(tokens / TOKENS_PER_WORDS))


# ---------------------------------------------------------------------------
# Measurement 2 (and 1): bursts on one server
# ---------------------------------------------------------------------------


def burst_run(server: Server, variant: str, pair: int, args: argparse.Namespace, prompt: str, sampler: Sampler) -> dict:
    """``--bursts`` bursts of ``--burst-clients`` streaming clients for
    ``--burst-s`` seconds (then each finishes its request), each followed by
    ``--idle-s`` seconds idle."""
    base = server.base
    first = status(base)
    before = metrics(base)
    ttft: list[float] = []
    by_burst: list[list[float]] = []
    first_wave: list[float] = []
    at_start: list[int] = []
    worker_before = cpu_and_faults(server)
    windows: list[tuple[float, float]] = []
    tokens, busy_s, failures = 0, 0.0, 0
    for _ in range(args.bursts):
        at_start.append(status(base)["kv_cache_limit_bytes"])
        started = time.monotonic()
        load = StreamingLoad(base, args.burst_clients, prompt, args.burst_max_tokens)
        with load:
            time.sleep(args.burst_s)
        ended = time.monotonic()
        busy_s += ended - started
        ttft += load.ttft_s
        by_burst.append(list(load.ttft_s))
        # The first request of each client: sent as the burst began, at the limit the idle left.
        order = sorted(range(len(load.sent_s)), key=load.sent_s.__getitem__)
        first_wave += [load.ttft_s[i] for i in order[: args.burst_clients]]
        tokens += load.tokens
        failures += len(load.failures)
        windows.append((sampler.rel(started), sampler.rel(ended)))
        time.sleep(args.idle_s)
    after = metrics(base)
    worker_after = cpu_and_faults(server)
    last = status(base)
    peak = max((r["limit_bytes"] for w in windows for r in sampler.window(BURST_VARIANTS[variant], *w)), default=None)
    changes_before, changes_after = ((s.get("autoscale") or {}).get("changes") for s in (first, last))
    row = {
        "measurement": "bursts",
        "pair": pair,
        "variant": variant,
        "tokens_per_s": tokens / busy_s if busy_s else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_max_s": max(ttft) if ttft else None,
        "requests": len(ttft),
        "failed": failures,
        "busy_s": busy_s,
        "preemptions": _count(_delta(before, after, "preemptions")),
        "limit_at_burst_start_bytes": at_start,
        "limit_at_burst_start_min_mib": c.mib(min(at_start)),
        "limit_peak_mib": c.mib(peak),
        "limit_changes": None if changes_before is None else changes_after - changes_before,
        "windows": windows,
        "ttft_s": ttft,
        "ttft_by_burst_s": by_burst,
        "ttft_first_wave_s": first_wave,
        "worker": None
        if worker_before is None or worker_after is None
        else {k: worker_after[k] - worker_before[k] for k in worker_before},
    }
    print(
        f"bursts pair {pair} {variant}: {c.fmt(row['tokens_per_s'])} tokens/s, TTFT p99 {c.fmt(row['ttft_p99_s'])} s, "
        f"{row['requests']} requests, {failures} failed, limit at burst start {c.fmt(row['limit_at_burst_start_min_mib'])} MiB",
        flush=True,
    )
    return row


def _delta(before: dict[str, float | None], after: dict[str, float | None], key: str) -> float | None:
    a, b = before.get(key), after.get(key)
    return b - a if a is not None and b is not None else None


def _count(value: float | None) -> int | None:
    return None if value is None else round(value)


def run_bursts(servers: dict[str, Server], args: argparse.Namespace, prompt: str, floor: int) -> tuple[list, Sampler]:
    auto = servers[BURST_AUTO]
    runs = []
    chosen = {BURST_AUTO: auto, BURST_STATIC: servers[BURST_STATIC]}
    with Sampler("bursts", chosen, args.sample_s) as sampler:
        if args.warm_up_s > 0:
            # Not measured: each server's first load in the session (the first
            # run of pair 0 is always the autoscaled one) meets its cold costs here.
            for name in (BURST_AUTO, BURST_STATIC):
                with StreamingLoad(servers[name].base, args.burst_clients, prompt, args.burst_max_tokens):
                    time.sleep(args.warm_up_s)
        for pair in range(args.pairs):
            order = ["autoscaled", "static"] if pair % 2 == 0 else ["static", "autoscaled"]
            for variant in order:
                if variant == "autoscaled":
                    wait_for(at_limit(auto.base, floor), "burst-auto at its floor")
                runs.append(burst_run(servers[BURST_VARIANTS[variant]], variant, pair, args, prompt, sampler))
    return runs, sampler


def idle_footprints(servers: dict[str, Server], floor: int, state: str) -> list[dict]:
    """Measurement 1: both burst servers' footprints, the autoscaled one at
    its floor and holding (its pages above the floor returned)."""
    auto = servers[BURST_AUTO]

    def at_floor() -> bool:
        st = status(auto.base)
        return st["kv_cache_limit_bytes"] == floor and st["holds"]

    waited = wait_for(at_floor, "burst-auto to shrink to its floor")
    time.sleep(1.0)  # the release follows the drain in the engine core's next pass
    rows = []
    for variant, name in BURST_VARIANTS.items():
        rows.append({"measurement": "idle", "state": state, "variant": variant, **steady_footprint(servers[name])})
    rows[0]["waited_for_floor_s"] = waited
    return rows


# ---------------------------------------------------------------------------
# Measurement 3: two servers, alternating load, one budget
# ---------------------------------------------------------------------------


def budget_variant(
    servers: dict[str, Server], variant: str, cycle: int, args: argparse.Namespace, prompt: str, sampler: Sampler
) -> list[dict]:
    """A busy for ``--phase-s`` while B idles, then B busy while A idles.
    At the switch A's clients stop sending. With ``--switch overlap`` A's
    last requests finish while B's load runs (and share the CPU with it);
    with ``--switch drain`` they finish before B's phase starts, so each
    phase's tokens/s is the busy server's alone. B's requests finish before
    the next variant."""
    a, b = BUDGET_VARIANTS[variant]
    rows = []
    loads = []
    with contextlib.ExitStack() as stack:
        for busy, idle in ((a, b), (b, a)):
            base = servers[busy].base
            before = metrics(base)
            started = time.monotonic()
            load = stack.enter_context(CompletionLoad(base, args.budget_clients, prompt, args.budget_max_tokens))
            time.sleep(args.phase_s)
            after = metrics(base)
            ended = time.monotonic()
            load.stop.set()  # no new requests; the stack waits for the last ones
            if args.switch == "drain":
                load.__exit__(None, None, None)  # joins the clients: their last requests finish here
            loads.append(load)
            generated = _delta(before, after, "tokens")
            rows.append(
                {
                    "measurement": "budget",
                    "cycle": cycle,
                    "variant": variant,
                    "phase": f"{busy} busy",
                    "busy": busy,
                    "idle": idle,
                    "t_start_s": sampler.rel(started),
                    "t_end_s": sampler.rel(ended),
                    "tokens_per_s": None if generated is None else generated / (ended - started),
                    "preemptions": _count(_delta(before, after, "preemptions")),
                    "completed": sum(1 for t in load.done if t <= ended),
                }
            )
    for row, load in zip(rows, loads):
        row["failed"] = len(load.failures)
        print(
            f"budget cycle {cycle} {variant}, {row['phase']}: {c.fmt(row['tokens_per_s'])} tokens/s, "
            f"{row['completed']} completed, {row['failed']} failed",
            flush=True,
        )
    return rows


def run_budget(servers: dict[str, Server], args: argparse.Namespace, prompt: str, locks: Path) -> tuple[list, Sampler]:
    chosen = {name: servers[name] for name in (BUDGET_A, BUDGET_B, HALF_A, HALF_B)}
    rows = []
    with Sampler("budget", chosen, args.sample_s, ((BUDGET_A, BUDGET_B),), locks) as sampler:
        for cycle in range(args.cycles):
            for variant in (SHARED, HALVES) if cycle % 2 == 0 else (HALVES, SHARED):
                rows += budget_variant(servers, variant, cycle, args, prompt, sampler)
    for row in rows:  # what the sampler saw in each phase
        busy = sampler.window(row["busy"], row["t_start_s"], row["t_end_s"])
        idle = sampler.window(row["idle"], row["t_start_s"], row["t_end_s"])
        row["running"] = mean_of(busy, "running")
        row["waiting"] = mean_of(busy, "waiting")
        limits = [r["limit_bytes"] for r in busy]
        row["busy_limit_mean_mib"] = c.mib(statistics.mean(limits)) if limits else None
        row["busy_limit_max_mib"] = c.mib(max(limits)) if limits else None
        top = max(limits, default=0)
        reached = [r["t_s"] for r in busy if top and r["limit_bytes"] >= 0.9 * top]
        # How long the autoscaled server took to take its share (a static limit is there at once).
        row["ramp_s"] = reached[0] - row["t_start_s"] if reached and row["variant"] == SHARED else None
        row["idle_limit_start_mib"] = c.mib(idle[0]["limit_bytes"]) if idle else None
        row["idle_limit_end_mib"] = c.mib(idle[-1]["limit_bytes"]) if idle else None
    return rows, sampler


# ---------------------------------------------------------------------------
# Summaries, plot
# ---------------------------------------------------------------------------


def summarize_idle(rows: list[dict], cap: int, floor: int) -> dict:
    idle = {r["variant"]: r for r in rows if r["state"] == "idle after bursts"}
    auto, static = idle.get("autoscaled", {}), idle.get("static", {})
    rss_a, rss_s = auto.get("worker_rss_bytes"), static.get("worker_rss_bytes")
    return {
        "worker_rss_ratio": ratio(rss_a, rss_s),
        "kv_resident_ratio": ratio(auto.get("kv_resident_bytes"), static.get("kv_resident_bytes")),
        "tree_rss_ratio": ratio(auto.get("tree_rss_bytes"), static.get("tree_rss_bytes")),
        "worker_rss_saved_mib": c.mib(rss_s - rss_a) if rss_a is not None and rss_s is not None else None,
        "cap_minus_floor_mib": c.mib(cap - floor),
    }


def summarize_bursts(runs: list[dict]) -> tuple[list[dict], dict]:
    pairs = []
    for pair in sorted({r["pair"] for r in runs}):
        got = {r["variant"]: r for r in runs if r["pair"] == pair}
        auto, static = got.get("autoscaled", {}), got.get("static", {})
        pairs.append(
            {
                "pair": pair,
                "tokens_per_s_ratio": ratio(auto.get("tokens_per_s"), static.get("tokens_per_s")),
                "ttft_p99_ratio": ratio(auto.get("ttft_p99_s"), static.get("ttft_p99_s")),
                "ttft_p50_ratio": ratio(auto.get("ttft_p50_s"), static.get("ttft_p50_s")),
            }
        )
    tps = median_of(p["tokens_per_s_ratio"] for p in pairs)
    p99 = median_of(p["ttft_p99_ratio"] for p in pairs)
    spreads = {
        f"{variant}_{key}_spread": rel_spread(r[key] for r in runs if r["variant"] == variant)
        for variant in BURST_VARIANTS
        for key in ("tokens_per_s", "ttft_p99_s")
    }
    pooled = {v: [t for r in runs if r["variant"] == v for t in r.get("ttft_s", ())] for v in BURST_VARIANTS}
    bursts = max((len(r.get("ttft_by_burst_s", ())) for r in runs), default=0)
    by_burst = {
        v: [[t for r in runs if r["variant"] == v for t in r["ttft_by_burst_s"][i]] for i in range(bursts)]
        for v in BURST_VARIANTS
    }
    waves = {v: [t for r in runs if r["variant"] == v for t in r.get("ttft_first_wave_s", ())] for v in BURST_VARIANTS}
    later = {
        v: [t for r in runs if r["variant"] == v for t in _without(r.get("ttft_s", []), r.get("ttft_first_wave_s", []))]
        for v in BURST_VARIANTS
    }
    worker = {
        v: {k: sum(r["worker"][k] for r in runs if r["variant"] == v and r.get("worker")) for k in WORKER_KEYS}
        for v in BURST_VARIANTS
    }
    summary = {
        "tokens_per_s_ratio_median": tps,
        "ttft_p99_ratio_median": p99,
        "ttft_p99_pooled_ratio": ratio(percentile(pooled["autoscaled"], 99), percentile(pooled["static"], 99)),
        "ttft_p99_pooled_ratio_90ci": bootstrap_ratio_ci(pooled["autoscaled"], pooled["static"], 99),
        "ttft_p50_pooled_ratio": ratio(percentile(pooled["autoscaled"], 50), percentile(pooled["static"], 50)),
        "requests_per_variant": {v: len(t) for v, t in pooled.items()},
        "ttft_p50_pooled_ratio_by_burst": [
            ratio(percentile(by_burst["autoscaled"][i], 50), percentile(by_burst["static"][i], 50))
            for i in range(bursts)
        ],
        "ttft_p50_pooled_ratio_first_wave": ratio(percentile(waves["autoscaled"], 50), percentile(waves["static"], 50)),
        "ttft_p50_pooled_ratio_after_first_wave": ratio(
            percentile(later["autoscaled"], 50), percentile(later["static"], 50)
        ),
        "worker_per_variant": worker,
        "worker_ratio": {k: ratio(worker["autoscaled"][k], worker["static"][k]) for k in WORKER_KEYS},
        "aim": "within 5%: tokens/s ratio >= 0.95 and p99 TTFT ratio <= 1.05",
        "aim_met": None if tps is None or p99 is None else tps >= 0.95 and p99 <= 1.05,
        "failed_requests": sum(r["failed"] for r in runs),
        **spreads,
    }
    return pairs, summary


WORKER_KEYS = ("user_s", "system_s", "minor_faults", "engine_core_s")


def _without(values: list[float], some: list[float]) -> list[float]:
    """``values`` less one occurrence of each of ``some``."""
    rest = list(values)
    for value in some:
        rest.remove(value)
    return rest


def bootstrap_ratio_ci(
    a: list[float], b: list[float], q: float, resamples: int = 2000, seed: int = 0
) -> list[float] | None:
    """A 90% bootstrap interval of percentile ``q`` of ``a`` over that of
    ``b`` (each resampled with replacement, a fixed seed): how far the
    pooled ratio can be trusted when the requests' own spread is large."""
    if not a or not b:
        return None
    rng = random.Random(seed)
    ratios = sorted(
        percentile(rng.choices(a, k=len(a)), q) / percentile(rng.choices(b, k=len(b)), q)  # type: ignore[operator]
        for _ in range(resamples)
    )
    return [ratios[int(0.05 * resamples)], ratios[int(0.95 * resamples) - 1]]


def summarize_budget(rows: list[dict], sampler: Sampler | None, budget: int) -> tuple[list[dict], dict]:
    cycles = []
    for cycle in sorted({r["cycle"] for r in rows}):
        entry: dict[str, Any] = {"cycle": cycle}
        for variant, key in ((SHARED, "shared"), (HALVES, "halves")):
            mine = [r for r in rows if r["cycle"] == cycle and r["variant"] == variant]
            entry[f"{key}_tokens_per_s"] = mean_of(mine, "tokens_per_s")
            entry[f"{key}_running"] = mean_of(mine, "running")
        entry["tokens_per_s_ratio"] = ratio(entry["shared_tokens_per_s"], entry["halves_tokens_per_s"])
        entry["running_ratio"] = ratio(entry["shared_running"], entry["halves_running"])
        cycles.append(entry)
    tps = median_of(e["tokens_per_s_ratio"] for e in cycles)
    sums = []
    ledger = []
    if sampler is not None:
        ticks: dict[int, list[dict]] = {}
        for r in sampler.rows:
            if r["server"] in (BUDGET_A, BUDGET_B):
                ticks.setdefault(r["tick"], []).append(r)
        sums = [sum(x["limit_bytes"] for x in v) for v in ticks.values() if len(v) == 2]
        ledger = [v[0]["ledger_holds_bytes"] for v in ticks.values() if v[0].get("ledger_holds_bytes") is not None]
    summary = {
        "tokens_per_s_ratio_median": tps,
        "running_ratio_median": median_of(e["running_ratio"] for e in cycles),
        "aim": "shared budget / static half split >= 1.5",
        "aim_met": None if tps is None else tps >= 1.5,
        "shared_tokens_per_s_spread": rel_spread(e["shared_tokens_per_s"] for e in cycles),
        "halves_tokens_per_s_spread": rel_spread(e["halves_tokens_per_s"] for e in cycles),
        "budget_bytes": budget,
        "limit_sum_max_bytes": max(sums) if sums else None,
        "limit_sum_over_budget_samples": sum(1 for s in sums if s > budget),
        "ledger_holds_max_bytes": max(ledger) if ledger else None,
        "samples": len(sums),
        "failed_requests": sum(r["failed"] for r in rows),
        "sampler_errors": len(sampler.errors) if sampler else 0,
    }
    return cycles, summary


def plot(
    samplers: list[Sampler], spans: dict[str, list[tuple[float, float, str, str]]], budget: int, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2 * len(samplers), 1, figsize=(9, 3.0 * 2 * len(samplers)), squeeze=False)
    for k, sampler in enumerate(samplers):
        limits, rates = axes[2 * k, 0], axes[2 * k + 1, 0]
        for name in sampler.servers:
            mine = [r for r in sampler.rows if r["server"] == name]
            t = [r["t_s"] for r in mine]
            color = COLORS.get(name)
            limits.plot(t, [c.mib(r["limit_bytes"]) for r in mine], color=color, label=f"{name} limit")
            rates.plot(t, [r["tokens_per_s"] for r in mine], color=color, label=name, linewidth=0.9)
            if sampler.measurement == "bursts":
                in_use = [c.mib(r["blocks_in_use"] * r["bytes_per_block"]) for r in mine]
                limits.plot(t, in_use, color=color, linestyle=":", linewidth=0.9, label=f"{name} in use")
        if sampler.measurement == "budget":
            ticks: dict[int, list[dict]] = {}
            for r in sampler.rows:
                if r["server"] in (BUDGET_A, BUDGET_B):
                    ticks.setdefault(r["tick"], []).append(r)
            both = [v for v in ticks.values() if len(v) == 2]
            t = [max(x["t_s"] for x in v) for v in both]
            limits.plot(
                t,
                [c.mib(sum(x["limit_bytes"] for x in v)) for v in both],
                color="black",
                linewidth=2,
                label="sum of budget-a and budget-b",
            )
            held = [(ts, v[0].get("ledger_holds_bytes")) for ts, v in zip(t, both) if v[0].get("ledger_holds_bytes")]
            if held:
                limits.plot(
                    [h[0] for h in held],
                    [c.mib(h[1]) for h in held],
                    color="black",
                    linestyle=":",
                    linewidth=1,
                    label="ledger: sum of holds",
                )
            limits.axhline(c.mib(budget), color="red", linestyle="--", linewidth=1, label="shared budget")
            limits.set_title("3. Two servers, alternating load: shared budget vs static half split", fontsize=9)
        else:
            limits.set_title("2. Bursts on one server: autoscaled vs static cap (same maximum)", fontsize=9)
        for start, end, variant, label in spans.get(sampler.measurement, []):
            for axis in (limits, rates):
                axis.axvspan(start, end, color=SPAN_COLORS.get(variant, "tab:gray"), alpha=0.08)
            limits.annotate(
                label,
                (start, 1),
                xycoords=("data", "axes fraction"),
                xytext=(2, -9),
                textcoords="offset points",
                fontsize=6,
            )
        limits.set_ylabel("KV cache MiB")
        rates.set_ylabel("generated tokens/s")
        rates.set_xlabel("seconds")
        limits.legend(loc="center right", fontsize=6)
        rates.legend(loc="upper right", fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def server_args(args: argparse.Namespace, model: str, cap: str, *extra: str) -> list[str]:
    out = [
        "--model",
        model,
        "--served-model-name",
        "tiny",
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--enforce-eager",
        "--kv-cache-max-memory",
        cap,
        "--worker-extension-cls",
        "tests.helpers.KVCacheProbe",
        *extra,
    ]
    if args.gpu_memory_utilization is not None:
        out += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.add_common_args(parser)
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=["bursts", "budget"],
        default=["bursts", "budget"],
        help="bursts: measurements 1 and 2 (two servers); budget: measurement 3 (four servers); default both",
    )
    parser.add_argument(
        "--shrink-after-s",
        type=float,
        default=5.0,
        help="VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S of the servers (default 5; the plugin's own default is 30)",
    )
    parser.add_argument(
        "--min-memory", default=None, help="--kv-cache-min-memory (default: the plugin's, one request of max-model-len)"
    )
    parser.add_argument("--max-model-len", type=int, default=2048, help="default 2048")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="default 64")
    parser.add_argument("--sample-s", type=float, default=0.5, help="seconds between samples (default 0.5)")
    parser.add_argument(
        "--name",
        default="autoscale",
        help="results/NAME.{csv,json,png}, NAME_samples.*, server logs NAME-*.log (default autoscale)",
    )
    bursts = parser.add_argument_group("measurements 1 and 2: bursts on one server")
    bursts.add_argument("--burst-cap", default="32M", help="--kv-cache-max-memory of both burst servers (default 32M)")
    bursts.add_argument("--burst-clients", type=int, default=16, help="concurrent streaming clients (default 16)")
    bursts.add_argument("--burst-prompt-tokens", type=int, default=576, help="prompt length, about (default 576)")
    bursts.add_argument("--burst-max-tokens", type=int, default=256, help="tokens generated per request (default 256)")
    bursts.add_argument("--bursts", type=int, default=2, help="bursts per run (default 2)")
    bursts.add_argument("--burst-s", type=float, default=10.0, help="seconds the clients keep sending (default 10)")
    bursts.add_argument(
        "--idle-s", type=float, default=8.0, help="seconds idle after each burst, above --shrink-after-s (default 8)"
    )
    bursts.add_argument("--pairs", type=int, default=2, help="autoscaled/static run pairs, ABBA order (default 2)")
    bursts.add_argument(
        "--warm-up-s",
        type=float,
        default=0.0,
        help="seconds of the burst load on each server before the pairs, not measured (default 0: none)",
    )
    budget = parser.add_argument_group("measurement 3: two servers, alternating load, one budget")
    budget.add_argument(
        "--budget", default="32M", help="the shared budget S; caps S (shared pair) and S/2 (half split); default 32M"
    )
    budget.add_argument("--budget-clients", type=int, default=16, help="clients on the busy server (default 16)")
    budget.add_argument("--budget-prompt-tokens", type=int, default=1440, help="prompt length, about (default 1440)")
    budget.add_argument("--budget-max-tokens", type=int, default=256, help="tokens generated per request (default 256)")
    budget.add_argument("--phase-s", type=float, default=25.0, help="seconds one server is busy (default 25)")
    budget.add_argument(
        "--switch",
        choices=["overlap", "drain"],
        default="overlap",
        help="at a switch, the server going idle finishes its last requests during the next phase (overlap, "
        "default) or before it starts (drain)",
    )
    budget.add_argument(
        "--cycles", type=int, default=2, help="A-then-B cycles per variant, the variants alternating (default 2)"
    )
    args = parser.parse_args()
    if "bursts" in args.parts and (args.pairs < 1 or args.bursts < 1):
        parser.error("--pairs and --bursts must be at least 1")
    if "budget" in args.parts and args.cycles < 1:
        parser.error("--cycles must be at least 1")
    return args


def check_plugin() -> None:
    """The servers run the installed package (its start-up hook imports it
    before the repository's copy could be found): it must autoscale."""
    if importlib.util.find_spec("vllm_kv_cache_limit.logic.autoscale_policy") is None:
        raise SystemExit(
            "the installed vllm_kv_cache_limit has no autoscaling (no vllm_kv_cache_limit.logic.autoscale_policy); "
            "reinstall it from this tree: .venv/bin/pip install .  (make test does)"
        )


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through api_servers, which stops every server


def started(up: dict[str, Server], prefix: str) -> dict[str, Server]:
    servers = {name.removeprefix(prefix): server for name, server in up.items()}
    for name, server in servers.items():
        if server.ready_s is None:
            state = f"exited {server.returncode}" if server.returncode is not None else "not ready"
            raise SystemExit(f"server {name} {state}; log {server.log_path}:\n{server.log_path.read_text()[-4000:]}")
    print("ready (s): " + ", ".join(f"{n} {s.ready_s:.1f}" for n, s in servers.items()), flush=True)
    return servers


def demand_note(
    what: str, clients: int, prompt_tokens: int, max_tokens: int, bpb: int, model: str, of: tuple[str, int]
) -> dict:
    """The load's KV demand when every request is at its last token, and
    its fraction of ``of`` (a name and bytes)."""
    block_tokens = max(1, bpb // c.kv_bytes_per_token(model))
    blocks = -(-(prompt_tokens + max_tokens) // block_tokens)
    peak = clients * blocks * bpb
    print(
        f"{what}: {clients} clients x ({prompt_tokens} prompt + {max_tokens} generated tokens) = {blocks} blocks "
        f"each, peak KV demand {c.fmt(c.mib(peak))} MiB = {peak / of[1]:.2f} of the {of[0]}",
        flush=True,
    )
    return {"prompt_tokens": prompt_tokens, "blocks_per_request": blocks, "peak_demand_bytes": peak}


def launch_specs(args: argparse.Namespace, model: str, budget: int) -> dict[str, list[str]]:
    """Each server's CLI arguments, for the parts asked for."""
    floor = ["--kv-cache-min-memory", args.min_memory] if args.min_memory else []
    specs: dict[str, list[str]] = {}
    if "bursts" in args.parts:
        specs[BURST_AUTO] = server_args(args, model, args.burst_cap, "--kv-cache-autoscale", *floor)
        specs[BURST_STATIC] = server_args(args, model, args.burst_cap, "--enable-kv-cache-resize")
    if "budget" in args.parts:
        shared = ["--kv-cache-autoscale", "--kv-cache-shared-budget", str(budget), *floor]
        for name in (BUDGET_A, BUDGET_B):
            specs[name] = server_args(args, model, str(budget), *shared)
        for name in (HALF_A, HALF_B):
            specs[name] = server_args(args, model, str(budget // 2), "--enable-kv-cache-resize")
    return specs


def measure_bursts(
    servers: dict[str, Server], first: dict[str, dict], args: argparse.Namespace, model: str, cap: int, notes: dict
) -> tuple[list[dict], list[dict], Sampler, int]:
    """Measurements 1 and 2: the footprints after start-up, the bursts, the
    footprints once idle. Returns the footprint rows, the runs, the sampler
    and the autoscaled server's floor."""
    auto = first[BURST_AUTO]["autoscale"]
    if not auto or first[BURST_STATIC]["autoscale"] is not None:
        raise SystemExit(f"burst-auto must autoscale and burst-static not: {first}")
    floor = auto["floor_bytes"]
    footprints = idle_footprints(servers, floor, "fresh")
    prompt = prompt_of(args.burst_prompt_tokens)
    prompt_tokens = complete(servers[BURST_AUTO].base, prompt, 1)["usage"]["prompt_tokens"]  # also a warm-up
    complete(servers[BURST_STATIC].base, prompt, 1)
    bpb = first[BURST_AUTO]["bytes_per_block"]
    notes["bursts_load"] = demand_note(
        "bursts", args.burst_clients, prompt_tokens, args.burst_max_tokens, bpb, model, ("cap", cap)
    )
    if args.idle_s <= args.shrink_after_s:
        print(f"note: --idle-s {args.idle_s:g} <= --shrink-after-s: bursts may keep their blocks", flush=True)
    runs, sampler = run_bursts(servers, args, prompt, floor)
    footprints += idle_footprints(servers, floor, "idle after bursts")
    return footprints, runs, sampler, floor


def measure_budget(
    servers: dict[str, Server],
    first: dict[str, dict],
    args: argparse.Namespace,
    model: str,
    budget: int,
    locks: Path,
    notes: dict,
) -> tuple[list[dict], Sampler]:
    """Measurement 3: the four servers' warm-up, then the phases."""
    for name in (BUDGET_A, BUDGET_B):
        if (first[name]["autoscale"] or {}).get("shared_budget") != budget:
            raise SystemExit(f"{name} is not in the shared budget {budget}: {first[name]}")
    prompt = prompt_of(args.budget_prompt_tokens)
    prompt_tokens = complete(servers[HALF_A].base, prompt, 1)["usage"]["prompt_tokens"]  # also a warm-up
    for name in (HALF_B, BUDGET_A, BUDGET_B):
        complete(servers[name].base, prompt, 1)
    bpb = first[BUDGET_A]["bytes_per_block"]
    note = demand_note(
        "budget", args.budget_clients, prompt_tokens, args.budget_max_tokens, bpb, model, ("budget", budget)
    )
    note["demand_over_budget"] = note["peak_demand_bytes"] / budget
    notes["budget_load"] = note
    floor = first[BUDGET_A]["autoscale"]["floor_bytes"]
    if note["peak_demand_bytes"] <= budget // 2:
        print("note: the load fits in half the budget; the static half split does not queue", flush=True)
    if note["peak_demand_bytes"] > budget - floor:
        print("note: the load needs more than the budget less the idle server's floor", flush=True)
    for name in (BUDGET_A, BUDGET_B):  # the warm-up's growth undone: both start at their floor
        wait_for(at_limit(servers[name].base, floor), f"{name} at its floor")
    return run_budget(servers, args, prompt, locks)


IDLE_COLUMNS = [
    ("state", "state"),
    ("variant", "variant"),
    ("worker_rss_mib", "worker RSS MiB"),
    ("kv_resident_mib", "KV resident MiB"),
    ("kv_mib", "KV allocated MiB"),
    ("limit_mib", "limit MiB"),
    ("tree_rss_mib", "tree RSS MiB"),
]
RUN_COLUMNS = [
    *c.PAIR_COLUMNS,
    ("tokens_per_s", "tokens/s"),
    ("ttft_p50_s", "TTFT p50 s"),
    ("ttft_p99_s", "TTFT p99 s"),
    ("requests", "requests"),
    ("failed", "failed"),
    ("preemptions", "preemptions"),
    ("limit_at_burst_start_min_mib", "limit at burst start MiB"),
    ("limit_peak_mib", "peak limit MiB"),
    ("limit_changes", "limit changes"),
]
RUN_RATIO_COLUMNS = [
    ("pair", "pair"),
    ("tokens_per_s_ratio", "tokens/s auto/static"),
    ("ttft_p99_ratio", "TTFT p99 auto/static"),
    ("ttft_p50_ratio", "TTFT p50 auto/static"),
]
PHASE_COLUMNS = [
    ("cycle", "cycle"),
    ("variant", "variant"),
    ("phase", "phase"),
    ("tokens_per_s", "busy tokens/s"),
    ("running", "running"),
    ("waiting", "waiting"),
    ("preemptions", "preemptions"),
    ("busy_limit_mean_mib", "busy limit MiB (mean)"),
    ("ramp_s", "s to 90% of its max"),
    ("idle_limit_end_mib", "idle's limit at end MiB"),
    ("failed", "failed"),
]
CYCLE_COLUMNS = [
    ("cycle", "cycle"),
    ("shared_tokens_per_s", "shared tokens/s"),
    ("halves_tokens_per_s", "half split tokens/s"),
    ("tokens_per_s_ratio", "tokens/s shared/half"),
    ("running_ratio", "running shared/half"),
]


def verdict(met: bool | None) -> str:
    return "-" if met is None else "met" if met else "missed"


def report_bursts(
    footprints: list[dict], runs: list[dict], cap: int, floor: int, args: argparse.Namespace
) -> tuple[dict, list[str]]:
    """The summaries and printed lines of measurements 1 and 2."""
    idle = summarize_idle(footprints, cap, floor)
    for r in footprints:
        for key in ("worker_rss_bytes", "tree_rss_bytes", "kv_resident_bytes", "kv_bytes", "limit_bytes"):
            r[key.replace("_bytes", "_mib")] = c.mib(r[key])
    pairs, bursts = summarize_bursts(runs)
    bursts["pairs"] = pairs
    f = c.fmt
    lines = [
        "1. Idle footprint (burst servers, both idle at once)",
        "",
        c.table(footprints, IDLE_COLUMNS),
        "",
        f"idle after bursts, autoscaled / static: worker RSS {f(idle['worker_rss_ratio'])}, KV resident "
        f"{f(idle['kv_resident_ratio'])}; worker RSS saved {f(idle['worker_rss_saved_mib'])} MiB (cap - floor "
        f"{f(idle['cap_minus_floor_mib'])} MiB); shrink after {args.shrink_after_s:g} s (benchmark setting; the "
        "plugin's default is 30 s)",
        "",
        "2. Bursty load on one server",
        "",
        c.table(runs, RUN_COLUMNS),
        "",
        c.table(pairs, RUN_RATIO_COLUMNS),
        "",
        f"median ratio autoscaled/static: tokens/s {f(bursts['tokens_per_s_ratio_median'])}, TTFT p99 "
        f"{f(bursts['ttft_p99_ratio_median'])}; spread between repeats, (max-min)/median: tokens/s autoscaled "
        f"{f(bursts['autoscaled_tokens_per_s_spread'])}, static {f(bursts['static_tokens_per_s_spread'])}; TTFT p99 "
        f"autoscaled {f(bursts['autoscaled_ttft_p99_s_spread'])}, static {f(bursts['static_ttft_p99_s_spread'])}",
        f"all requests of a variant pooled ({bursts['requests_per_variant']}), autoscaled/static: TTFT p99 "
        f"{f(bursts['ttft_p99_pooled_ratio'])} (90% bootstrap interval {bursts['ttft_p99_pooled_ratio_90ci']}), "
        f"TTFT p50 {f(bursts['ttft_p50_pooled_ratio'])}",
        f"aim: {bursts['aim']}: {verdict(bursts['aim_met'])} (a same-variant spread above 0.05 means the run "
        "cannot resolve it)",
    ]
    return {"idle": idle, "bursts": bursts}, lines


def report_budget(phases: list[dict], sampler: Sampler, budget: int) -> tuple[dict, list[str]]:
    """The summary and printed lines of measurement 3."""
    cycles, g = summarize_budget(phases, sampler, budget)
    g["cycles"] = cycles
    f = c.fmt
    lines = [
        f"3. Two servers, alternating load, one budget of {f(c.mib(budget))} MiB",
        "",
        c.table(phases, PHASE_COLUMNS),
        "",
        c.table(cycles, CYCLE_COLUMNS),
        "",
        f"median ratio shared/half split: tokens/s {f(g['tokens_per_s_ratio_median'])}, running "
        f"{f(g['running_ratio_median'])}; spread between repeats, (max-min)/median: shared "
        f"{f(g['shared_tokens_per_s_spread'])}, half split {f(g['halves_tokens_per_s_spread'])}",
        f"sum of the shared pair's limits: max {f(c.mib(g['limit_sum_max_bytes']))} MiB of {f(c.mib(budget))}, "
        f"{g['limit_sum_over_budget_samples']} of {g['samples']} samples over; ledger holds at most "
        f"{f(c.mib(g['ledger_holds_max_bytes']))} MiB",
        f"aim: {g['aim']}: {verdict(g['aim_met'])}",
    ]
    return g, lines


def plot_spans(runs: list[dict], phases: list[dict]) -> dict[str, list[tuple[float, float, str, str]]]:
    """The loaded windows to shade in the plot: (start, end, variant, label)."""
    spans: dict[str, list[tuple[float, float, str, str]]] = {"bursts": [], "budget": []}
    for run in runs:
        label = "auto" if run["variant"] == "autoscaled" else "static"
        spans["bursts"] += [(start, end, run["variant"], label) for start, end in run["windows"]]
    for phase in phases:
        label = f"{'shared' if phase['variant'] == SHARED else 'half'} {phase['busy'][-1].upper()}"
        spans["budget"].append((phase["t_start_s"], phase["t_end_s"], phase["variant"], label))
    return spans


def main() -> None:
    args = parse_args()
    check_plugin()
    from vllm_kv_cache_limit.logic.sizes import parse_size

    model = c.model_path(args)
    cap, budget = parse_size(args.burst_cap), parse_size(args.budget)
    specs = launch_specs(args, model, budget)
    signal.signal(signal.SIGTERM, _terminate)
    c.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    footprints: list[dict] = []
    runs: list[dict] = []
    phases: list[dict] = []
    samplers: list[Sampler] = []
    floor = 0
    settings: dict[str, Any] = {"args": vars(args), "servers": specs}
    with tempfile.TemporaryDirectory(prefix="bench-autoscale-") as tmp:
        locks = Path(tmp) / "locks"  # fresh: no other run's start-up lock or ledger
        env = c.bench_env(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_KV_CACHE_LIMIT_LOCK_DIR=str(locks),
            VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S=f"{args.shrink_after_s:g}",
        )
        launch: dict[str, Any] = {f"{args.name}-{name}": (cli, env) for name, cli in specs.items()}
        print(f"starting {len(launch)} servers at once (lock folder {locks}) ...", flush=True)
        # api_servers stops every server, process groups included, however this block ends.
        with api_servers(launch, c.RESULTS_DIR, c.ENGINE_TIMEOUT_S, c.REPO) as up:
            servers = started(up, f"{args.name}-")
            first = {name: status(server.base) for name, server in servers.items()}
            settings["status_at_start"] = first
            if "bursts" in args.parts:
                footprints, runs, sampler, floor = measure_bursts(servers, first, args, model, cap, settings)
                samplers.append(sampler)
            if "budget" in args.parts:
                phases, sampler = measure_budget(servers, first, args, model, budget, locks, settings)
                samplers.append(sampler)
        print("servers stopped", flush=True)

    summary: dict[str, Any] = {}
    lines: list[str] = []
    if "bursts" in args.parts:
        found, lines = report_bursts(footprints, runs, cap, floor, args)
        summary.update(found)
    if "budget" in args.parts:
        summary["budget"], more = report_budget(phases, samplers[-1], budget)
        lines += ([""] if lines else []) + more
    png = c.RESULTS_DIR / f"{args.name}.png"
    plot(samplers, plot_spans(runs, phases), budget, png)
    settings["sampler_errors"] = {s.measurement: s.errors[:20] for s in samplers}
    csv_path, json_path = c.save(args.name, footprints + runs + phases, {"summary": summary, "settings": settings})
    c.save(f"{args.name}_samples", [row for s in samplers for row in s.rows], {"settings": settings})
    print()
    print("\n".join(lines))
    print(f"\nplot: {png}; results: {csv_path}, {json_path}; server logs: {c.RESULTS_DIR}/{args.name}-*.log")


if __name__ == "__main__":
    main()
