"""Benchmark 6, sharing a device: three OpenAI servers with caps launched at
the same instant, default utilization, with the start-up lock and without it.

    .venv/bin/python benchmarks/bench_shared_startup.py [--caps 16M 32M 48M] [--rounds 2]

The variants alternate (lock, no lock, no lock, lock, ...). For each launch
it records when each server answered /health, the time until all did, which
servers failed to start, and each worker's KV cache bytes (read in the
worker through ``/collective_rpc`` and ``tests.helpers.KVCacheProbe``). "no lock"
sets ``VLLM_KV_CACHE_LIMIT_STARTUP_LOCK=0``. Reports the ratio of the time to
all-ready, lock / no lock, per round pair.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import _common as c
import requests

from tests.helpers import api_servers
from vllm_kv_cache_limit.logic.sizes import parse_size


def launch(model: str, caps: list[int], lock: bool, folder: Path) -> dict:
    servers = {}
    for i, cap in enumerate(caps):
        env = c.bench_env(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_KV_CACHE_LIMIT_LOCK_DIR=str(folder / "locks"),
            VLLM_KV_CACHE_LIMIT_STARTUP_LOCK="1" if lock else "0",
        )
        args = [
            "--model",
            model,
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--kv-cache-max-memory",
            str(cap),
            "--worker-extension-cls",
            "tests.helpers.KVCacheProbe",
        ]
        servers[f"s{i}"] = (args, env)
    row: dict = {"variant": "lock" if lock else "no lock"}
    with api_servers(servers, folder, c.ENGINE_TIMEOUT_S, c.REPO) as running:
        ready = [s.ready_s for s in running.values()]
        row["failed"] = sum(r is None for r in ready)
        row["all_ready_s"] = max(r for r in ready) if not row["failed"] else None
        for i, server in enumerate(running.values()):
            row[f"ready_s_{i}"] = server.ready_s
            kv = None
            if server.ready_s is not None:
                reply = requests.post(f"{server.base}/collective_rpc", json={"method": "kv_cache_bytes"}, timeout=60)
                kv = [int(b) for b in reply.json()["results"]] if reply.ok else None
            row[f"kv_bytes_{i}"] = kv[0] if kv else None
            row[f"kv_is_cap_{i}"] = kv == [caps[i]] if kv else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.add_common_args(parser)
    parser.add_argument("--caps", nargs="+", default=["16M", "32M", "48M"])
    parser.add_argument("--rounds", type=int, default=2, help="lock/no-lock pairs (ABBA order)")
    args = parser.parse_args()
    model = c.model_path(args)
    caps = [parse_size(x) for x in args.caps]
    rows = []
    for r in range(args.rounds):
        order = [True, False] if r % 2 == 0 else [False, True]
        for lock in order:
            with tempfile.TemporaryDirectory() as tmp:
                row = launch(model, caps, lock, Path(tmp))
            row["round"] = r
            rows.append(row)
            print(
                c.table(
                    [row],
                    [("round", "round"), ("variant", "variant"), ("all_ready_s", "all ready s"), ("failed", "failed")],
                ),
                flush=True,
            )
    ratios = []
    for r in range(args.rounds):
        pair = {row["variant"]: row["all_ready_s"] for row in rows if row["round"] == r}
        if pair.get("lock") and pair.get("no lock"):
            ratios.append(pair["lock"] / pair["no lock"])
    columns = [("round", "round"), ("variant", "variant"), ("all_ready_s", "all ready (s)"), ("failed", "failed")]
    for i in range(len(caps)):
        columns += [(f"ready_s_{i}", f"ready {args.caps[i]} (s)"), (f"kv_is_cap_{i}", f"KV = {args.caps[i]}")]
    print(c.table(rows, columns))
    summary = {
        "ratio_all_ready_lock_over_no_lock": ratios,
        "median_ratio": statistics.median(ratios) if ratios else None,
    }
    print("all-ready time, lock / no lock, per round:", ", ".join(f"{x:.2f}" for x in ratios))
    c.save("shared_startup", rows, {"summary": summary, "caps": caps})


if __name__ == "__main__":
    main()
