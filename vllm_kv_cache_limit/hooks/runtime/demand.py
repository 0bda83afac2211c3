"""The autoscaler's demand, read from vLLM's scheduler: the whole of it once
per decision, and between decisions only the requests that arrived, so that
an engine core with thousands of waiting requests does not go over all of
them at every step (``Autoscaler.tick``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_kv_cache_limit.logic.limit_math import NULL_BLOCKS


def rose(demand: int, decided: int, limit: int) -> bool:
    """Whether ``demand`` rose since the last decision (``decided``) and
    needs more blocks than ``limit``: a grow is decided at once."""
    return demand > decided and demand + NULL_BLOCKS > limit


@dataclass
class DemandReader:
    """One engine core's demand in blocks (on its autoscaler)."""

    group_caps: list[tuple[int, int]]
    """Per KV cache group: tokens per block, and the most blocks one request needs."""
    max_model_len: int
    counted: dict[str, Any] = field(default_factory=dict)
    """The requests in ``estimate``: the scheduler's at the last whole read,
    and those that arrived since."""
    estimate: int = 0
    """The demand of the last whole read plus that of the arrivals since: at
    least the demand (requests that finished since still count), exact while
    none has."""
    wait_for_tick: bool = False
    """Arrivals decide nothing before the next tick: the last decision left
    the demand above a limit that could not grow to it (the ceiling, the
    shared budget), or a read for arrivals found no rise (requests had
    finished)."""

    def blocks(self, request: Any) -> int:
        """Blocks ``request`` holds and will need to finish (its prompt and
        ``max_tokens``, at least its tokens and the next, at most
        ``max_model_len``), over the KV cache groups."""
        tokens = min(self.max_model_len, max(request.num_tokens + 1, request.num_prompt_tokens + request.max_tokens))
        return sum(min(most, -(-tokens // block_size)) for block_size, most in self.group_caps)

    def read(self, scheduler: Any, most: int | None = None) -> int:
        """The demand of every unfinished request (one pass over them), at
        most ``most`` blocks: the pass stops once it is reached. Why: the
        autoscaler decides alike for every demand at or above its ceiling,
        and a queue of thousands would otherwise be walked at each decision."""
        requests = scheduler.requests
        total, groups, most_tokens = 0, self.group_caps, self.max_model_len
        for request in requests.values():  # ``blocks`` inlined: this pass is the autoscaler's largest cost
            tokens = max(request.num_tokens + 1, request.num_prompt_tokens + request.max_tokens)
            tokens = min(most_tokens, tokens)
            for block_size, cap in groups:
                total += min(cap, -(-tokens // block_size))
            if most is not None and total >= most:
                total = most
                break
        self.estimate = total
        self.counted = dict(requests)
        return total

    def arrived(self, scheduler: Any) -> int:
        """``estimate`` with the requests that arrived since the last call:
        vLLM's scheduler adds a request at the end of ``requests`` and
        removes it when it finishes, so the arrivals are the requests after
        the last one counted (a request whose id came back is another
        object). Goes over the arrivals only."""
        requests = scheduler.requests
        counted = self.counted
        arrivals = []
        for request_id in reversed(requests):
            request = requests[request_id]
            if counted.get(request_id) is request:
                break
            arrivals.append(request)
            counted[request_id] = request
        self.estimate += sum(self.blocks(request) for request in arrivals)
        return self.estimate

    def may_rise(self, scheduler: Any, decided: int, limit: int) -> bool:
        """Between decisions: whether the arrivals may have raised the
        demand above ``limit`` (then the whole of it is read); counts none
        while ``wait_for_tick``."""
        return not self.wait_for_tick and rose(self.arrived(scheduler), decided, limit)
