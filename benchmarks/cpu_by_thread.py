"""CPU time by thread and by CPU, from ``/proc``: where a benchmark's
processes ran while it ran, and how much each took (RESULTS.md 8i: which
process took the bursting server's CPU).

    .venv/bin/python benchmarks/cpu_by_thread.py record OUT SECONDS   # beside a benchmark
    .venv/bin/python benchmarks/cpu_by_thread.py report OUT [--min-s 1]

``record`` reads ``/proc/<pid>/task/<tid>/stat`` of every thread every 0.5 s
(user + system ticks and the CPU it last ran on) and writes one line a
thread a sample, and a JSON line per process when first seen (its command
line and its allowed CPUs). ``report`` gives each thread's CPU seconds over
the recording, split by the CPU the samples found it on (ticks between two
samples are charged to the CPU of the later one: a thread that moves
between samples is split roughly).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def record(out: Path, seconds: float, every_s: float = 0.5) -> None:
    end = time.monotonic() + seconds
    seen: set[str] = set()
    with open(out, "w") as sink:
        while time.monotonic() < end:
            began = time.monotonic()
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                        name = stat[stat.index("(") + 1 : stat.rindex(")")]
                        fields = stat[stat.rindex(")") + 2 :].split()
                        ticks, cpu = int(fields[11]) + int(fields[12]), int(fields[36])
                        if pid not in seen:
                            seen.add(pid)
                            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
                            allowed = next(
                                line.split()[1]
                                for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                                if line.startswith("Cpus_allowed_list")
                            )
                            sink.write(json.dumps({"pid": pid, "cmd": cmd[:200], "cpus": allowed}) + "\n")
                        sink.write(f"{began:.2f} {pid} {tid} {name.replace(' ', '_')} {ticks} {cpu}\n")
                except (OSError, ValueError, StopIteration):
                    continue  # the process or thread ended meanwhile
            sink.flush()
            time.sleep(max(0.0, every_s - (time.monotonic() - began)))


def report(path: Path, min_s: float) -> None:
    processes: dict[str, dict] = {}
    first: dict[tuple[str, str, str], tuple[float, int]] = {}
    last: dict[tuple[str, str, str], tuple[float, int]] = {}
    by_cpu: dict[tuple[str, str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            processes[entry["pid"]] = entry
            continue
        at, pid, tid, name, ticks, cpu = line.split()
        key = (pid, tid, name)
        if key in last and int(ticks) > last[key][1]:
            by_cpu[key][cpu] += int(ticks) - last[key][1]
        first.setdefault(key, (float(at), int(ticks)))
        last[key] = (float(at), int(ticks))
    start = min((at for at, _ in first.values()), default=0.0)
    print("cpu_s  from_s  to_s  pid/tid  thread  allowed  by CPU (s)  command")
    for key in sorted(last, key=lambda k: (int(k[0]), int(k[1]))):
        used = (last[key][1] - first[key][1]) * TICK_S
        if used < min_s:
            continue
        pid, tid, name = key
        split = ", ".join(f"{cpu}: {n * TICK_S:.0f}" for cpu, n in sorted(by_cpu[key].items()))
        info = processes.get(pid, {})
        print(
            f"{used:6.1f} {first[key][0] - start:6.0f} {last[key][0] - start:5.0f}  {pid}/{tid}  {name}  "
            f"{info.get('cpus', '?')}  {{{split}}}  {info.get('cmd', '?')[-70:]}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="sample every thread's CPU time for SECONDS")
    rec.add_argument("out", type=Path)
    rec.add_argument("seconds", type=float)
    rep = sub.add_parser("report", help="CPU seconds by thread and CPU from a recording")
    rep.add_argument("path", type=Path)
    rep.add_argument("--min-s", type=float, default=1.0, help="leave out threads that used less (default 1 s)")
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, args.seconds)
    else:
        report(args.path, args.min_s)


if __name__ == "__main__":
    main()
