"""Autoscaled limits and one shared budget on real CPU engines: two servers
launched at once, one of them as in its own container (``unshare`` with its
own PID namespace, host name and ``TMPDIR``, the lock folder given
explicitly), both autoscaled under one budget. Load on A only, then B only,
then both: at every sample their limits add up to at most the budget, no
request fails, A's limit rises while B idles and falls back when B needs
blocks; an idle server falls to its floor and its worker's memory falls by
the bytes released (a fall after idling releases lazily, ``MADV_FREE``: the
pages leave RSS only when the kernel needs them, so "fell" is RSS less
``LazyFree`` and "resident" leaves out the lazily freed pages), and ``vllm:kv_cache_limit_bytes`` follows the limit; a
manual resize sets the ceiling the autoscaler stays under (and is refused
below the floor); killed with SIGKILL, B gives its share back and A grows
into it; a worker of A killed mid-run takes its share with it."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from tests.e2e.conftest import api_servers, budget_server_args, engine_env
from tests.helpers import CompletionLoad, Periodic, ledger_holds, live_ledger_entries, locked, metric
from vllm_kv_cache_limit.logic.sizes import parse_size

pytestmark = [pytest.mark.plugin_only, pytest.mark.smoke]  # autoscaling is the plugin's; every CPU build

MiB = 2**20
CAP = 48 * MiB
BUDGET = 40 * MiB
"""Less than the two caps together, more than either one's load needs alone."""
SHRINK_AFTER_S = 5
"""A short hysteresis (the documented variable): idle servers fall to their floor soon."""
MAX_MODEL_LEN = 2048
CLIENTS = 24
PROMPT = "the quick brown fox jumps over the lazy dog " * 150
"""About 1350 tokens: with 100 generated, 12 blocks of 128 tokens a request,
so 24 clients ask for about 288 blocks (36 MiB) of KV cache, more than half
the budget."""
MAX_TOKENS = 100
HOST_B = "container-b"
ROUTE = "/kv_cache/max_memory"
LIMIT_METRIC = "vllm:kv_cache_limit_bytes"
RELEASED_RE = re.compile(
    r"KV cache pages of blocks \d+-\d+ released(?: lazily)?: RSS(?: less LazyFree)? fell by (\d+) bytes"
)
BOUND_S = 240
"""What a change of phase may take on the 2-core test machine."""


def unshare_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "--uts", "true"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


def container(hostname: str, tmpdir: Path) -> list[str]:
    """A command prefix that runs a server as in its own container: its own
    PID namespace (and /proc), its own host name, its own ``TMPDIR``."""
    return [
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        "--uts",
        "sh",
        "-c",
        f'hostname {hostname} && TMPDIR={tmpdir} exec "$@"',
        "sh",
    ]


@pytest.fixture(scope="module")
def pair(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not unshare_available():
        pytest.fail("unshare --pid --fork --mount-proc --uts does not run here; the container case needs it")
    folder = tmp_path_factory.mktemp("autoscale")
    locks = folder / "locks"
    args = budget_server_args(
        tiny_model, CAP, BUDGET, MAX_MODEL_LEN, "--worker-extension-cls", "tests.helpers.KVCacheProbe"
    )
    env = engine_env(
        VLLM_SERVER_DEV_MODE="1",
        VLLM_KV_CACHE_LIMIT_LOCK_DIR=str(locks),
        VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S=str(SHRINK_AFTER_S),
    )
    tmp_b = folder / "tmp-b"
    tmp_b.mkdir()
    env_a, env_b = dict(env), {**env, "TMPDIR": str(tmp_b)}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        # Each server's OpenMP threads on half the cores, as two instances
        # sharing a CPU host are run: both bound to all cores, they contend
        # (an engine core then waits a minute on its worker).
        half = len(cores) // 2
        env_a["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[:half]))
        env_b["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[half:]))
    # A also serves POST: a manual resize while autoscaling sets the ceiling.
    specs = {"a": ([*args, "--enable-kv-cache-resize"], env_a), "b": (args, env_b, container(HOST_B, tmp_b))}
    with api_servers(specs, folder) as running:
        yield {"servers": running, "locks": locks, "tmp_b": tmp_b}


def status(base: str) -> dict[str, Any]:
    reply = requests.get(base + ROUTE, timeout=180)
    assert reply.status_code == 200, reply.text
    return reply.json()


def worker_rpc(base: str, method: str) -> list[int]:
    reply = requests.post(base + "/collective_rpc", json={"method": method}, timeout=60)
    assert reply.status_code == 200, reply.text
    return [int(r) for r in reply.json()["results"]]


class Sampler(Periodic):
    """Samples both servers' limits every half second in a thread: A, B,
    then A again, so that for each sample ``min(A before, A after) + B``
    is at most what both held at the instant B was read."""

    def __init__(self, a: str, b: str, locks: Path) -> None:
        super().__init__(0.5)
        self.a, self.b, self.locks = a, b, locks
        self.samples: list[dict[str, Any]] = []

    def sample(self) -> None:
        a1, b, a2 = status(self.a), status(self.b), status(self.a)
        self.samples.append(
            {
                "t": time.monotonic(),
                "a": min(a1["kv_cache_limit_bytes"], a2["kv_cache_limit_bytes"]),
                "b": b["kv_cache_limit_bytes"],
                "a_max": max(a1["kv_cache_limit_bytes"], a2["kv_cache_limit_bytes"]),
                "ledger": sum(ledger_holds(self.locks)),
            }
        )


def sampled(sampler: Sampler, key: str) -> int:
    """The highest ``key`` the sampler has recorded so far (0 before the first sample)."""
    return max((int(s[key]) for s in list(sampler.samples)), default=0)


def load(base: str, clients: int = CLIENTS) -> CompletionLoad:
    return CompletionLoad(base, clients, PROMPT, MAX_TOKENS)


def wait_for(condition: Any, what: str, timeout: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_two_autoscaled_servers_share_one_budget(pair: dict[str, Any]) -> None:
    a, b = (pair["servers"][name][0] for name in ("a", "b"))
    log_a = pair["servers"]["a"][1]
    first_a, first_b = status(a), status(b)
    floor = first_a["autoscale"]["floor_bytes"]
    bpb = first_a["bytes_per_block"]
    # Premise: both started at their floor, under one budget that holds both floors.
    assert first_a["autoscale"]["shared_budget"] == first_b["autoscale"]["shared_budget"] == BUDGET
    assert first_a["kv_cache_limit_bytes"] == first_b["kv_cache_limit_bytes"] == floor < BUDGET // 8
    assert first_a["kv_cache_allocated_bytes"] == first_b["kv_cache_allocated_bytes"] == CAP
    # Each worker holds no more of its KV cache than the floor: the rest went back at start-up.
    for base in (a, b):
        assert max(worker_rpc(base, "kv_cache_resident_bytes")) <= floor + 2 * bpb

    runs: list[CompletionLoad] = []
    with Sampler(a, b, pair["locks"]) as sampler:
        with contextlib.ExitStack() as on_b_stack:
            # A only: A grows past half the budget while B idles at its floor.
            with load(a) as on_a:
                runs.append(on_a)
                wait_for(lambda: status(a)["kv_cache_limit_bytes"] > BUDGET // 2, "A to grow past half the budget")
                assert status(b)["kv_cache_limit_bytes"] == floor
                peak_a = status(a)["kv_cache_limit_bytes"]
                # The metric follows the autoscaled limit (refreshed at each scrape).
                wait_for(lambda: metric(a, LIMIT_METRIC) == status(a)["kv_cache_limit_bytes"], "the metric", 60)
                assert metric(a, LIMIT_METRIC) > BUDGET // 2
                # The samples show it too before B's load starts (a sample takes three
                # status calls, slow under load, and A gives back within a tick of B's demand).
                wait_for(lambda: sampled(sampler, "a_max") > BUDGET // 2, "a sample of A past half the budget", 60)
                # Then B: it needs blocks while A holds most of the budget (so
                # A's own hysteresis cannot be what lowers it), and A stops.
                given_back = log_a.read_text().count("another instance needs the shared budget")
                runs.append(on_b_stack.enter_context(load(b)))
            wait_for(lambda: status(b)["kv_cache_limit_bytes"] > BUDGET // 2, "B to grow past half the budget")
            assert status(a)["kv_cache_limit_bytes"] < peak_a
            assert log_a.read_text().count("another instance needs the shared budget") > given_back
            wait_for(lambda: sampled(sampler, "b") > BUDGET // 2, "a sample of B past half the budget", 60)
            # Both: A's burst grows it back beside busy B, within the budget.
            with load(a) as on_a:
                runs.append(on_a)
                wait_for(lambda: status(a)["kv_cache_limit_bytes"] > 4 * floor, "A to grow beside busy B")
                # The premise of the release below: A's load made pages resident above the floor.
                wait_for(
                    lambda: max(worker_rpc(a, "kv_cache_resident_bytes")) - floor > 4 * MiB,
                    "A's pages above the floor to be resident",
                )
                resident_a = max(worker_rpc(a, "kv_cache_resident_bytes"))
                seen = len(log_a.read_text())
        # Idle: both fall to their floor, and A's worker gives the pages back.
        for base in (a, b):
            wait_for(lambda base=base: status(base)["kv_cache_limit_bytes"] == floor, "idle servers at their floor")
            wait_for(lambda base=base: status(base)["holds"], "the drain to hold", 60)
        # The premise of the checks below: enough samples (a sample under load can take seconds).
        wait_for(lambda: len(sampler.samples) > 20, "21 samples of both limits", 60)
    # A's worker measured its RSS (less LazyFree) around each release since:
    # the falls add up to the pages it held above the floor (in one step or several).
    fell = sum(int(n) for n in RELEASED_RE.findall(log_a.read_text()[seen:]))
    assert resident_a - floor > 4 * MiB, (resident_a, floor)  # premise: A's load made pages resident
    assert fell >= 0.9 * (resident_a - floor - 2 * bpb), (fell, resident_a, floor)
    assert max(worker_rpc(a, "kv_cache_resident_bytes")) <= floor + 2 * bpb
    assert metric(a, LIMIT_METRIC) == floor
    # The first burst after idling grows A back, with no failed request.
    with load(a) as on_a:
        runs.append(on_a)
        wait_for(lambda: status(a)["kv_cache_limit_bytes"] > BUDGET // 2, "A to grow again after idling")

    samples = sampler.samples
    assert not sampler.errors, sampler.errors[:3]
    assert len(samples) > 20, len(samples)
    over = [s for s in samples if s["a"] + s["b"] > BUDGET or s["ledger"] > BUDGET]
    assert not over, over[:5]
    assert sampled(sampler, "b") > BUDGET // 2 and sampled(sampler, "a_max") > BUDGET // 2, samples[-5:]
    failures = [f for run in runs for f in run.failures]
    assert not failures, failures[:3]
    assert all(run.completed > 0 for run in runs), [run.completed for run in runs]


def test_manual_resize_sets_the_ceiling_the_autoscaler_stays_under(pair: dict[str, Any]) -> None:
    a = pair["servers"]["a"][0]
    before = status(a)
    floor, bpb = before["autoscale"]["floor_bytes"], before["bytes_per_block"]
    ceiling = 8 * MiB
    reply = requests.post(a + ROUTE, json={"size": "8M"}, timeout=180)
    assert reply.status_code == 200, reply.text
    assert reply.json()["autoscale"]["ceiling_bytes"] == ceiling
    seen = []
    with load(a) as on_a:
        # The demand is far above 8M: the limit rises to the ceiling and no further.
        wait_for(lambda: seen.append(status(a)["kv_cache_limit_bytes"]) or seen[-1] == ceiling, "A at its ceiling")
        for _ in range(20):
            seen.append(status(a)["kv_cache_limit_bytes"])
            time.sleep(0.5)
    assert max(seen) == ceiling and not on_a.failures, (seen, on_a.failures[:3])
    # Below the floor (here one request of max_model_len, the default): refused, the ceiling kept.
    refused = requests.post(a + ROUTE, json={"size": "1M"}, timeout=180)
    # The suggestion is a size that is accepted: at least the floor, as written.
    suggested = re.search(r"Choose a size of at least (\S+) \((\d+) bytes\)", refused.text)
    assert refused.status_code == 400 and suggested and int(suggested[2]) == floor, refused.text
    assert parse_size(suggested[1]) >= floor, refused.text
    assert status(a)["autoscale"]["ceiling_bytes"] == ceiling
    back = requests.post(a + ROUTE, json={"size": f"{CAP // MiB}M"}, timeout=180)
    assert back.status_code == 200 and back.json()["autoscale"]["ceiling_bytes"] == CAP, back.text
    assert ceiling % bpb == 0 and before["autoscale"]["ceiling_bytes"] == CAP


def test_container_instance_shares_the_lock_and_the_ledger(pair: dict[str, Any]) -> None:
    logs = {name: path.read_text() for name, (_, path) in pair["servers"].items()}
    # The container's start-up lock and ledger are the shared folder's, not its own TMPDIR's.
    own = [p for p in pair["tmp_b"].rglob("*") if p.name.endswith((".lock", ".entry")) or p.name.startswith("budget-")]
    assert not own, own
    hosts = {"a": socket.gethostname(), "b": HOST_B}
    # Whichever started second waited for the other's start-up lock and names
    # it by its host name (the container's own for B) and its pid there.
    waited = {
        name: re.findall(r"Waiting for the KV cache start-up lock of .*, held by (.+?) since", log)
        for name, log in logs.items()
    }
    second = [name for name, found in waited.items() if found]
    assert len(second) == 1, waited
    other = "a" if second[0] == "b" else "b"
    assert all(re.fullmatch(rf"{re.escape(hosts[other])} pid \d+", label) for label in waited[second[0]]), waited
    # ... and its ledger line names the first as well.
    joined = re.findall(r"KV cache autoscale on: .*others hold \S+ \(([^)]*)\)", logs[second[0]])
    assert len(joined) == 1 and re.fullmatch(rf"{re.escape(hosts[other])} pid \d+", joined[0]), joined
    windows = []
    for name, log in logs.items():
        acquired = re.findall(r"start-up lock acquired .*acquired at (\d+\.\d+)", log)
        released = re.findall(r"start-up lock released .*released at (\d+\.\d+)", log)
        assert len(acquired) == len(released) == 1, (name, acquired, released)
        windows.append((float(acquired[0]), float(released[0])))
    windows.sort()
    assert windows[0][1] <= windows[1][0], windows


STALL_BOUND_S = 60
"""Eight short completions on an idle server answer well within this, with
or without the ledger's lock held from outside."""


def test_a_ledger_lock_held_from_outside_stalls_no_request(pair: dict[str, Any]) -> None:
    """Anyone who may open the ledger's lock file may hold it: while an
    outside process holds it, A answers every completion and its status in
    time, keeps its limit, and says it found the ledger locked; once the
    lock is free, it decides with the ledger again."""
    import fcntl
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.conftest import complete

    a, log_a = pair["servers"]["a"]
    (ledger_dir,) = pair["locks"].glob("budget-*")
    seen = len(log_a.read_text())
    fd = os.open(ledger_dir / "ledger.lock", os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # The premise: A's decisions meet the held lock (one per tick, idle or not).
        wait_for(lambda: status(a)["autoscale"]["ledger_locked_s"] is not None, "A to find the ledger locked", 60)
        before = status(a)  # no decision changes the limit from here while the lock is held
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:
            replies = list(pool.map(lambda i: complete(a, f"{i} Hello", max_tokens=8), range(8)))
        took = time.monotonic() - started
        assert [r["usage"]["completion_tokens"] for r in replies] == [8] * 8
        assert took < STALL_BOUND_S, f"8 completions took {took:.0f} s with the ledger's lock held"
        held = status(a)
        assert held["kv_cache_limit_bytes"] == before["kv_cache_limit_bytes"], (before, held)
        wait_for(lambda: "is locked by another process" in log_a.read_text()[seen:], "A to log the locked ledger", 60)
    finally:
        os.close(fd)  # drops the lock
    wait_for(lambda: status(a)["autoscale"]["ledger_locked_s"] is None, "A to use the ledger again", 60)
    wait_for(lambda: "ledger is free again after" in log_a.read_text()[seen:], "A to log the free ledger", 60)
    assert log_a.read_text()[seen:].count("is locked by another process") == 1  # once, not at every decision


def test_killed_instance_gives_its_share_back(pair: dict[str, Any]) -> None:
    a = pair["servers"]["a"][0]
    floor = status(a)["autoscale"]["floor_bytes"]
    base_b, log_b = pair["servers"]["b"]
    assert "KV cache autoscale on" in log_b.read_text()
    # Each instance's worker holds a companion of its entry, locked: the
    # entry stays counted until the worker exits, whatever order they die in.
    entries = sorted(p.name for p in pair["locks"].glob("budget-*/*.entry"))
    companions = sorted(pair["locks"].glob("budget-*/*.entry.w*"))
    assert len(entries) == 2 and sorted(c.name.rpartition(".w")[0] for c in companions) == entries, companions
    assert all(locked(c) for c in companions), companions
    pgid = _server_pgid(base_b)
    os.killpg(pgid, signal.SIGKILL)
    wait_for(lambda: _gone(pgid), "B's processes to go", 60)
    # More clients than the budget holds: A wants all of it.
    with load(a, 2 * CLIENTS) as on_a:
        # With B alive at its floor, A could hold at most the budget less B's floor.
        wait_for(lambda: status(a)["kv_cache_limit_bytes"] > BUDGET - floor, "A to grow into B's share after B died")
    assert not on_a.failures, on_a.failures[:3]
    others = status(a)["autoscale"]["others"]
    assert others == [], others
    (left,) = pair["locks"].glob("budget-*/*.entry")
    # B's entry and its worker's companion went together; A's are there.
    assert [c.name for c in pair["locks"].glob("budget-*/*.entry.w*")] == [f"{left.name}.w0"]


def _server_pgid(base: str) -> int:
    """The process group of the server on ``base``'s port: the ``unshare``
    process it was started under leads it."""
    return os.getpgid(_serving(base, unshare=True).pid)


def _gone(pgid: int) -> bool:
    """Whether no live process is left in the group (the ``unshare``
    process stays a zombie until the fixture reaps it)."""
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return False
        except (ProcessLookupError, psutil.Error):
            continue
    return True


def test_a_worker_killed_mid_run_takes_its_share_with_it(pair: dict[str, Any]) -> None:
    """Last (it ends A): A's worker killed with SIGKILL while A is loaded and
    holds most of the budget. A's engine core stops, and its share goes back
    to the ledger without anyone cleaning up: no entry is left that a live
    process holds."""
    a, log_a = pair["servers"]["a"]
    locks = pair["locks"]
    server = _serving(a)
    with load(a, 2 * CLIENTS):
        wait_for(lambda: status(a)["kv_cache_limit_bytes"] > BUDGET // 2, "A to grow under load")
        assert live_ledger_entries(locks) == 1 and max(ledger_holds(locks)) > BUDGET // 2, ledger_holds(locks)
        workers = [
            child for child in server.children(recursive=True) if " ".join(child.cmdline()).startswith("VLLM::Worker")
        ]
        assert len(workers) == 1, workers
        workers[0].kill()
        wait_for(lambda: live_ledger_entries(locks) == 0, "A's share to go back after its worker died", 120)
    assert "died unexpectedly" in log_a.read_text(), log_a.read_text()[-3000:]


def _serving(base: str, unshare: bool = False) -> psutil.Process:
    """The process started with ``--port`` of ``base``: the ``unshare``
    process a server runs under, or (``unshare=False``) the API server."""
    port = base.rsplit(":", 1)[1]
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        under = cmdline[:1] == ["unshare"]
        if under == unshare and "--port" in cmdline and cmdline[cmdline.index("--port") + 1] == port:
            return proc
    raise AssertionError(f"no {'unshare' if unshare else 'server'} process serving port {port}")
