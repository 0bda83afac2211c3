"""The fault soak's invariant checker and fault scheduler (``soak.py``),
apart from the servers so that they can be tested on injected readings
(``tests/unit/test_soak_checks.py``). The readings from outside (``read_ledger``, ``group_pids``, ``memory``,
``cpu_seconds``, ``cpu_ticks``) are here too. No vLLM import here.

The checker gets one reading a second (the ledger's live entries, each
instance's state and status, read from outside) and every finished
request, and records each violation of the soak's invariants with its
time, its values and the fault in progress:

(a) the holds in the ledger add up to at most the budget; while an
    instance starts, at most the budget plus that instance's cap (its
    start-up reservation, docs/autoscale.md);
(b) what an instance commits (its limit, or the blocks in use above a
    draining limit) is at most its ledger hold plus one chunk (undecided,
    and counted, when its entry was rewritten while its status was read:
    a hold between the two ledger reads is unknown);
(c) no request of an instance that was not itself killed or stopped fails
    or takes longer than ``request_s``;
(d) a killed instance's entry is counted by nobody (the ledger and every
    survivor's ``others``) within ``freed_s`` of the exit of the last of
    its processes (seen by a reading: a second's resolution);
(e) a restarted instance serves and holds an entry within ``join_s``;
(f) no log of one episode (one start of one instance) has more than one
    traceback;
(g) a killed instance's entry is counted while one of its workers (the
    processes that hold its KV cache: its engine core's children) runs:
    the ledger never says less than the memory still held.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kv_cache_limit.logic import budget_ledger

KINDS = ("kill", "stop", "lock", "malformed", "fill", "api_kill", "budget")
"""The faults: SIGKILL an instance's process group and restart it; SIGSTOP
it for a while; hold its ledger lock from outside; plant a malformed ledger
entry and a malformed instance entry; fill the lock folder's disk; SIGKILL
its API server alone and restart it; restart it with another budget (which
must be refused), then with the budget."""
EXCUSING = ("kill", "stop", "api_kill", "budget")
"""The faults after which the instance's own requests may fail or wait."""


@dataclass
class Bounds:
    """The bounds the invariants are checked against (seconds)."""

    request_s: float = 60.0
    freed_s: float = 10.0
    join_s: float = 300.0
    grace_s: float = 5.0
    """After an instance is up again, its requests are still excused this long."""


@dataclass
class Fault:
    """One fault: when it starts (seconds of soak), its kind, its instance and how long it lasts."""

    at: float
    kind: str
    target: str
    hold_s: float = 0.0
    slow_exits: dict[int, list[tuple[float, str]]] = field(default_factory=dict)
    """For a kill: each process that outlived it by ``SLOW_EXIT_S``, its states (``watch_exits``)."""

    def label(self) -> str:
        held = f" for {self.hold_s:.0f} s" if self.hold_s else ""
        return f"{self.kind} {self.target}{held} at {self.at:.0f} s"


SLOW_EXIT_S = 3.0
"""A killed process still not reaped this long after its kill has its states recorded with the fault."""


class FaultScheduler:
    """One fault at a time, every ``lo``-``hi`` seconds, its kind and instance
    drawn from ``random.Random(seed)``: the same seed replays the same faults."""

    HOLDS = {"stop": (20.0, 60.0), "lock": (5.0, 30.0), "malformed": (10.0, 30.0), "fill": (10.0, 30.0)}

    def __init__(self, seed: int, kinds: list[str], targets: list[str], lo: float, hi: float) -> None:
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}: choose among {', '.join(KINDS)}")
        if not kinds or not targets:
            raise ValueError("the soak needs at least one fault kind and one instance")
        if not 0 < lo <= hi:
            raise ValueError(f"the interval {lo}-{hi} s is not 0 < lo <= hi, for example 30 60")
        self.rng = random.Random(seed)
        self.kinds, self.targets, self.lo, self.hi = list(kinds), list(targets), lo, hi

    def next(self, now: float) -> Fault:
        """The next fault, starting a random interval after ``now``."""
        at = now + self.rng.uniform(self.lo, self.hi)
        kind = self.rng.choice(self.kinds)
        lo, hi = self.HOLDS.get(kind, (0.0, 0.0))
        return Fault(at, kind, self.rng.choice(self.targets), round(self.rng.uniform(lo, hi), 1) if hi else 0.0)


@dataclass
class Instance:
    """An instance as one reading sees it: ``state`` is ``up``, ``starting``,
    ``stopping`` (a fault or the soak is ending it: its processes may be
    dying, so its hold is not checked), ``down`` or ``stopped``; ``pids``
    its process group's processes."""

    state: str
    cap: int
    pids: set[int] = field(default_factory=set)
    status: dict[str, Any] | None = None


@dataclass
class Reading:
    """One second of the soak, read from outside: the ledger's live, valid
    entries (each with the ``pid`` of its label) and every instance."""

    t: float
    budget: int
    ledger: list[dict[str, Any]]
    instances: dict[str, Instance]
    fault: str | None = None
    before: list[dict[str, Any]] = field(default_factory=list)
    """The ledger read just before the statuses (``ledger`` just after): a
    hold that fell between them is compared at its old value, as the
    status may show the limit before the fall."""
    running: set[int] | None = None
    """Of the killed processes the checker waits on (``Checker.awaited``),
    those that have not exited; None: not read (then they count as exited
    at their kill)."""


@dataclass
class Killed:
    """A kill the checker follows until the instance's entry goes: (d) and (g)."""

    t: float
    name: str
    pids: set[int]
    workers: set[int]
    """The processes of ``pids`` that hold the KV cache."""
    exited: float | None = None
    """The first reading that found every one of ``pids`` exited."""


def looped(
    requests: list[tuple[float, int, int]], start_s: float, length_s: float, period_s: float
) -> list[tuple[float, int, int]]:
    """The ``requests`` of a trace of ``period_s`` (at seconds from its start)
    from ``start_s`` for ``length_s``, the trace replayed again from its
    start each time it ends: a soak longer than the trace (the Azure traces
    are an hour each) keeps its traffic. Times are from ``start_s``."""
    if period_s <= 0:
        raise ValueError(f"a trace's period must be positive, not {period_s!r}")
    out = []
    for lap in range(int((start_s + length_s) // period_s) + 1):
        for at, prompt, tokens in requests:
            t = at + lap * period_s - start_s
            if 0 <= t < length_s:
                out.append((t, prompt, tokens))
    return sorted(out)


def place(loads: dict[str, float], cpus: list[int]) -> dict[str, int]:
    """A CPU for each instance, by its traffic (``loads``, any measure of
    work): the heaviest first, each on the CPU with the least load so far
    (the lowest-numbered on a tie). With fewer CPUs than instances, the
    busiest traces are kept apart: two of them on one CPU leave it saturated
    while another idles, and the requests of both wait on the CPU, not on
    anything the soak checks."""
    if not cpus:
        raise ValueError("no CPU to place the instances on")
    load = {cpu: 0.0 for cpu in cpus}
    out = {}
    for name in sorted(loads, key=lambda n: (-loads[n], n)):
        cpu = min(cpus, key=lambda k: (load[k], k))
        out[name] = cpu
        load[cpu] += loads[name]
    return out


def label_pid(label: Any) -> int | None:
    """The pid of a ledger entry's label, ``<host> pid <pid>``."""
    try:
        return int(str(label).rsplit(" pid ", 1)[1])
    except (IndexError, ValueError):
        return None


def workers_of(pid: int) -> set[int]:
    """The workers of the engine core ``pid``: its children, less Python's
    multiprocessing resource tracker (it holds no KV cache)."""
    found = set()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                found |= {int(child) for child in (task / "children").read_text().split()}
    return {
        child
        for child in found
        if b"resource_tracker" not in _read_bytes(Path(f"/proc/{child}/cmdline")) and proc_state(child) is not None
    }


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def group_pids(pgid: int) -> set[int]:
    """The live processes of the process group ``pgid``."""
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    found.add(int(entry.name))
    return found


def wait_gone(pgid: int, seconds: float) -> set[int]:
    """Wait up to ``seconds`` for the process group ``pgid`` to have no
    live process; the pids still alive then."""
    deadline = time.monotonic() + seconds
    while (left := group_pids(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def pids_with_env(name: str, value: str) -> set[int]:
    """The live processes started with ``name=value`` in their environment
    (``/proc/<pid>/environ``): a soak's servers, found by its own lock
    folder, including one whose start was still in progress."""
    wanted = f"{name}={value}".encode()
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if wanted in Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
    return found


def _task_state(stat: Path) -> str:
    """One task's state letter and kernel wait channel (``"D folio_wait_bit"``)."""
    state = stat.read_text().rsplit(")", 1)[1].split()[0]
    wchan = (stat.parent / "wchan").read_text().strip()
    return f"{state} {wchan}" if wchan not in ("", "0") else state


def proc_state(pid: int) -> str | None:
    """What ``pid`` is doing, from ``/proc``: its state and wait channel;
    for an exited main thread ("Z") whose other threads still run their
    exit (the process keeps its memory until the last one has), theirs
    too: ``"Z; 2 threads left: D folio_wait_bit, R"``. None once reaped."""
    try:
        state = _task_state(Path(f"/proc/{pid}/stat"))
        if not state.startswith("Z"):
            return state
        left = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError):
                if int(task.name) != pid and not (other := _task_state(task / "stat")).startswith(("Z", "X")):
                    left.append(other)
    except (OSError, IndexError):
        return None
    return f"Z; {len(left)} threads left: {', '.join(sorted(left))}" if left else state


def exited(state: str) -> bool:
    """Whether a ``proc_state`` (or "gone") is a process that has exited,
    all its threads: a zombie holds no memory and no lock, whoever reaps
    it and when."""
    return state == "gone" or state == "Z"


def watch_exits(pids: set[int], seconds: float, every_s: float = 0.1) -> dict[int, list[tuple[float, str]]]:
    """Each of ``pids``' states (``proc_state``, "gone" once reaped) from
    now until it has exited or ``seconds`` pass, one row per change with
    its seconds since the call: what a killed process that outlives its
    kill was doing (running, or waiting in the kernel, and on what), and
    while it has not exited the memory it still holds (``"R; rss 768
    MiB"``, in steps of 64 MiB above 64 MiB): whether its memory was gone
    before its ledger entry."""
    start = time.monotonic()
    seen: dict[int, list[tuple[float, str]]] = {pid: [] for pid in pids}
    while True:
        t = time.monotonic() - start
        for pid, rows in seen.items():
            if rows and exited(rows[-1][1]):
                continue
            state = proc_state(pid) or "gone"
            rss = None if exited(state) else resident(pid)
            if rss is not None:
                mib = rss >> 20
                state += f"; rss {mib if mib < 64 else mib // 64 * 64} MiB"
            if not rows or rows[-1][1] != state:
                rows.append((round(t, 2), state))
        if t >= seconds or all(exited(rows[-1][1]) for rows in seen.values()):
            return seen
        time.sleep(every_s)


def memory(pid: int) -> dict[str, int] | None:
    """RSS and ``LazyFree`` of ``pid`` in bytes (``/proc/<pid>/smaps_rollup``)."""
    return memory_at(Path(f"/proc/{pid}"))


def memory_at(proc: Path) -> dict[str, int] | None:
    """RSS and ``LazyFree`` in bytes from ``<proc>/smaps_rollup`` (a process's or a thread's folder)."""
    out = {}
    try:
        for line in (proc / "smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "LazyFree"):
                out[key] = int(rest.split()[0]) * 1024
    except OSError:
        return None
    return out


def cpu_seconds(pids: set[int]) -> float:
    """User plus system CPU seconds that ``pids`` have used so far
    (``/proc/<pid>/stat``); a process already gone adds nothing."""
    ticks = 0
    for pid in pids:
        try:  # the fields after the command, whose name may hold spaces and parentheses
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
        except (OSError, IndexError, ValueError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> dict[int, tuple[int, int]]:
    """Per CPU, its busy and its total clock ticks so far (``/proc/stat``;
    idle and iowait are not busy)."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name != "cpu":
            ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
            out[int(name[3:])] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
    return out


def busy(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> dict[int, float | None]:
    """Per CPU, the share of the time between two ``cpu_ticks`` it was busy
    (None where no tick passed)."""
    out: dict[int, float | None] = {}
    for cpu, (used, total) in after.items():
        used0, total0 = before.get(cpu, (used, total))
        out[cpu] = round((used - used0) / (total - total0), 3) if total > total0 else None
    return out


def resident(pid: int) -> int | None:
    """The bytes ``pid`` still has resident, also once its main thread has
    exited and another thread still runs (read from that thread: the main
    thread's own ``/proc`` files show no memory then); None once none can
    be read."""
    threads = [t for t in sorted(Path(f"/proc/{pid}/task").glob("*")) if t.name != str(pid)]  # the main one first
    for path in (Path(f"/proc/{pid}"), *threads):
        mem = memory_at(path)
        if mem and "Rss" in mem:
            return mem["Rss"]
    return None


def read_ledger(lock_dir: Path, wait_s: float = 0.5) -> tuple[list[dict[str, Any]], bool]:
    """The live, valid entries of every budget ledger in ``lock_dir``, each
    with the ``pid`` of its label, read with the plugin's reader
    (``budget_ledger``): under the ledger's lock (shared) when it is free
    within ``wait_s``, else without it (whoever holds it that long writes
    nothing then). Whether every ledger was read under its lock."""
    entries, locked = [], True
    for folder in sorted(lock_dir.glob("budget-*")):
        lock = os.open(folder / budget_ledger.LEDGER_LOCK, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            deadline, held = time.monotonic() + wait_s, False
            while not held and time.monotonic() < deadline:
                try:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    held = True
                except BlockingIOError:
                    time.sleep(0.02)
            locked &= held
            dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                entries += _live_entries(dir_fd)
            finally:
                os.close(dir_fd)
        finally:
            os.close(lock)  # drops the lock
    return entries, locked


def _live_entries(dir_fd: int) -> list[dict[str, Any]]:
    """The entries of the ledger folder open on ``dir_fd`` whose
    engine core or one of whose workers lives (``budget_ledger.held``)."""
    entries = []
    names = os.listdir(dir_fd)
    for name in sorted(n for n in names if n.endswith(budget_ledger.ENTRY_SUFFIX)):
        with contextlib.suppress(OSError):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
            try:
                if not budget_ledger.held(dir_fd, name, fd, names):
                    continue  # no live owner
                record = budget_ledger._read(fd)
                written = os.fstat(fd).st_mtime_ns
            except ValueError:
                continue
            finally:
                os.close(fd)
            if budget_ledger.record_problem(record) is None:
                entries.append({**record, "pid": label_pid(record.get("label")), "file": name, "written_ns": written})
    return entries


class Checker:
    """Checks each reading and request against the invariants (module docstring)."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.violations: list[dict[str, Any]] = []
        self.worst: dict[str, float] = {
            "ledger_over_budget_bytes": float("-inf"),
            "ledger_over_budget_starting_bytes": float("-inf"),
            "committed_over_hold_bytes": float("-inf"),
            "request_s": 0.0,
            "freed_s": 0.0,
            "freed_after_kill_s": 0.0,
            "join_s": 0.0,
            "tracebacks_per_episode": 0,
        }
        self.windows: dict[str, list[list[float]]] = {}
        """Per instance, the spans its own requests are excused (a fault on it, until it is up again)."""
        self.dying: list[Killed] = []
        self.joining: dict[str, float] = {}
        self.episodes: dict[str, int] = {}
        self.slowest: dict[str, Any] = {}
        """The slowest request checked against (c): its instance, when it was sent, how long it took."""
        self.fault: str | None = None
        self.undecided_b = 0
        """Readings of (b) over the bound whose entry was rewritten between the ledger reads."""
        self.requests = {"sent": 0, "completed": 0, "failed": 0, "failed_excused": 0}

    def violate(self, t: float, invariant: str, **values: Any) -> None:
        self.violations.append({"t_s": round(t, 2), "invariant": invariant, "fault": self.fault, **values})

    # -- what the soak tells it -------------------------------------------------
    def excuse(self, name: str, t: float) -> None:
        """A fault on ``name`` began at ``t``: its requests are excused until :meth:`back`."""
        self.windows.setdefault(name, []).append([t, float("inf")])

    def back(self, name: str, t: float) -> None:
        for window in self.windows.get(name, []):
            if window[1] == float("inf"):
                window[1] = t + self.bounds.grace_s

    def killed(self, pids: set[int], t: float, name: str, workers: set[int] | None = None) -> None:
        """The processes ``pids`` of ``name`` were killed at ``t``: their
        entries must go within ``freed_s`` of the last one's exit (d), and
        not while one of ``workers`` runs (g)."""
        self.dying.append(Killed(t, name, set(pids), set(workers or ())))

    def awaited(self) -> set[int]:
        """The killed processes whose exits the next reading should say (``Reading.running``)."""
        return {pid for k in self.dying for pid in k.pids}

    def restarting(self, name: str, t: float) -> None:
        self.joining[name] = t

    # -- checks -----------------------------------------------------------------
    def sample(self, r: Reading) -> None:
        self.fault = r.fault
        held = sum(int(e["holds"]) for e in r.ledger)
        starting = [i for i in r.instances.values() if i.state == "starting"]
        over = held - r.budget
        key = "ledger_over_budget_starting_bytes" if starting else "ledger_over_budget_bytes"
        self.worst[key] = max(self.worst[key], over)
        allowed = r.budget + max((i.cap for i in starting), default=0)
        if held > allowed:
            self.violate(r.t, "a", held=held, budget=r.budget, allowed=allowed)
        by_pid = {e["pid"]: e for e in r.ledger if e.get("pid") is not None}
        holds: dict[int, int] = {}
        for e in [*r.before, *r.ledger]:
            if e.get("pid") is not None:
                holds[e["pid"]] = max(holds.get(e["pid"], 0), int(e["holds"]))
        earlier = {e["pid"]: e for e in r.before if e.get("pid") is not None}
        moved = {  # rewritten between the reads: its hold while the status was read is unknown
            p
            for p, e in by_pid.items()
            if p in earlier and (earlier[p].get("written_ns"), earlier[p]["holds"]) != (e.get("written_ns"), e["holds"])
        }
        for name, inst in r.instances.items():
            self._committed(r.t, name, inst, holds, moved)
        self._freed(r)
        self._joined(r, by_pid)

    def _committed(self, t: float, name: str, inst: Instance, by_pid: dict[int, int], moved: set[int]) -> None:
        status = inst.status
        if inst.state != "up" or not status or not status.get("bytes_per_block"):
            return
        block = int(status["bytes_per_block"])
        committed = max(int(status.get("kv_cache_limit_bytes") or 0), int(status.get("num_blocks_in_use") or 0) * block)
        holds = max((by_pid[p] for p in inst.pids if p in by_pid), default=0)
        excess = committed - holds
        if excess > block and inst.pids & moved:
            self.undecided_b += 1
            return
        self.worst["committed_over_hold_bytes"] = max(self.worst["committed_over_hold_bytes"], excess)
        if excess > block:  # one chunk: a block on the CPU backend
            self.violate(t, "b", instance=name, committed=committed, holds=holds, chunk=block)

    def _freed(self, r: Reading) -> None:
        counted = {e["pid"] for e in r.ledger}
        for inst in r.instances.values():
            others = ((inst.status or {}).get("autoscale") or {}).get("others") or []
            if inst.state == "up":
                counted |= {label_pid(o.get("label")) for o in others if isinstance(o, dict)}
        for k in list(self.dying):
            running = k.pids & r.running if r.running is not None else set()
            if k.exited is None and not running:
                k.exited = r.t if r.running is not None else k.t
            still = sorted(k.pids & counted)
            if not still:
                if k.workers & running:
                    self.violate(
                        r.t, "g", instance=k.name, running=sorted(k.workers & running), since_kill_s=round(r.t - k.t, 1)
                    )
                self.worst["freed_s"] = max(self.worst["freed_s"], 0.0 if k.exited is None else r.t - k.exited)
                self.worst["freed_after_kill_s"] = max(self.worst["freed_after_kill_s"], r.t - k.t)
                self.dying.remove(k)
            elif k.exited is not None and r.t - k.exited > self.bounds.freed_s:
                self.violate(
                    r.t,
                    "d",
                    instance=k.name,
                    pid=still[0],
                    counted_for_s=round(r.t - k.t, 1),
                    after_exit_s=round(r.t - k.exited, 1),
                    bound_s=self.bounds.freed_s,
                )
                self.dying.remove(k)

    def _joined(self, r: Reading, by_pid: dict[int, dict[str, Any]]) -> None:
        for name, since in list(self.joining.items()):
            inst = r.instances.get(name)
            took = r.t - since
            if inst is not None and inst.state == "up" and any(p in by_pid for p in inst.pids):
                self.worst["join_s"] = max(self.worst["join_s"], took)
                del self.joining[name]
            elif took > self.bounds.join_s:
                self.violate(r.t, "e", instance=name, waited_s=round(took, 1), bound_s=self.bounds.join_s)
                del self.joining[name]

    def request(self, name: str, sent: float, ended: float, error: str | None) -> None:
        """One request of ``name`` sent at ``sent`` ended at ``ended``, with ``error`` or None."""
        self.requests["sent"] += 1
        excused = any(lo <= ended and sent <= hi for lo, hi in self.windows.get(name, []))
        if error is None:
            self.requests["completed"] += 1
        else:
            self.requests["failed_excused" if excused else "failed"] += 1
        if excused:
            return
        took = ended - sent
        if took > self.worst["request_s"]:
            self.worst["request_s"] = took
            self.slowest = {"instance": name, "sent_s": round(sent, 1), "took_s": round(took, 2), "fault": self.fault}
        if error is not None:
            self.violate(ended, "c", instance=name, error=error[:300])
        elif took > self.bounds.request_s:
            self.violate(ended, "c", instance=name, took_s=round(took, 2), bound_s=self.bounds.request_s)

    def tracebacks(self, t: float, episode: str, count: int) -> None:
        """``count`` tracebacks are in the log of ``episode`` so far: a violation (once) past one."""
        before = self.episodes.get(episode, 0)
        self.episodes[episode] = max(before, count)
        self.worst["tracebacks_per_episode"] = max(self.worst["tracebacks_per_episode"], count)
        if count > 1 >= before:
            self.violate(t, "f", episode=episode, tracebacks=count)

    def finish(self, t: float) -> None:
        """At the end: entries never freed and joins never made are violations."""
        for k in self.dying:
            self.violate(t, "d", instance=k.name, pids=sorted(k.pids), counted_for_s=round(t - k.t, 1), exited=k.exited)
        for name, since in self.joining.items():
            self.violate(t, "e", instance=name, waited_s=round(t - since, 1), bound_s=self.bounds.join_s)
        self.dying.clear()
        self.joining.clear()

    def summary(self) -> dict[str, Any]:
        worst = {k: (None if v == float("-inf") else v) for k, v in self.worst.items()}
        return {
            "worst": worst,
            "slowest": self.slowest,
            "requests": dict(self.requests),
            "undecided_b": self.undecided_b,
            "violations": self.violations,
        }
