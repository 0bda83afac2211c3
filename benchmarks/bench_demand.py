"""Benchmark 8b, the autoscaler's cost per engine step: ``Autoscaler.tick``
as the engine core calls it after every step, between two decisions, for a
scheduler holding N unfinished requests, with one KV cache group and with
two (a hybrid model). Since the demand is read whole once per decision
(``hooks.runtime.demand``), a tick between decisions counts only the
requests that arrived, none here: this measures that floor, and
``bench_demand_steps.py`` (8b2) the whole read at each decision on vLLM's
real scheduler.

    .venv/bin/python benchmarks/bench_demand.py [--requests 16 64 256 1024] [--repeats 2000]

No engine: stand-in requests with vLLM's attribute names, the plugin's own
``Autoscaler``. The time is the median of ``--repeats`` calls, in
microseconds, and per request; compare it with a step of the model served
(a CPU step of the tiny Llama takes milliseconds, a GPU decode step of a
real model about 10-50 ms).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import _common as c


def autoscaler(groups: int):  # -> Autoscaler
    from vllm_kv_cache_limit.hooks.runtime.autoscaler import Autoscaler
    from vllm_kv_cache_limit.logic.autoscale_policy import Hysteresis, Policy
    from vllm_kv_cache_limit.logic.limit_math import Allocation

    allocation = Allocation(num_blocks=100_000, bytes_per_block=2**16, blocks_per_request=256, max_model_len=4096)
    return Autoscaler(
        allocation=allocation,
        hysteresis=Hysteresis(Policy(257, 256, shrink_after_s=30.0)),
        ceiling=allocation.num_blocks,
        set_limit=lambda *args: {},
        group_caps=[(16, 256)] * groups,
        max_model_len=4096,
    )


def measure(requests: int, groups: int, repeats: int) -> dict:
    rng = random.Random(requests * 10 + groups)
    scheduler = SimpleNamespace(requests={})
    for i in range(requests):
        prompt = rng.randint(16, 2048)
        scheduler.requests[str(i)] = SimpleNamespace(
            num_tokens=prompt + rng.randint(0, 256), num_prompt_tokens=prompt, max_tokens=rng.randint(16, 1024)
        )
    engine = SimpleNamespace(scheduler=scheduler)
    scaler = autoscaler(groups)
    pool_limit = SimpleNamespace(limit=100_000, withheld=set())
    now = time.monotonic()
    scaler.tick(engine, pool_limit, now)  # the decision; the calls timed below come between two
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        scaler.tick(engine, pool_limit, now)
        samples.append(time.perf_counter() - start)
    median_us = statistics.median(samples) * 1e6
    return {
        "requests": requests,
        "kv_cache_groups": groups,
        "tick_us": median_us,
        "tick_us_per_request": median_us / requests,
        "tick_us_p90": statistics.quantiles(samples, n=10)[-1] * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    rows = [measure(n, g, args.repeats) for g in (1, 2) for n in args.requests]
    c.print_table(
        rows,
        [
            ("requests", "requests"),
            ("kv_cache_groups", "groups"),
            ("tick_us", "tick (us, median)"),
            ("tick_us_p90", "tick (us, p90)"),
            ("tick_us_per_request", "us per request"),
        ],
    )
    csv_path, json_path = c.save("demand", rows, {"args": vars(args)})
    print(f"results: {csv_path}, {json_path}")


if __name__ == "__main__":
    main()
