"""A device's shared KV cache budget (``--kv-cache-shared-budget``) as an
engine core's autoscaler takes part in it: reserving its start-up
allocation in every device's ledger (``logic.budget_ledger``) before vLLM
commits it, joining once it has fallen to its floor, refusing a budget that
differs from the others' or cannot hold every floor, and leaving at
shutdown. The ledger never says less than the workers commit."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit.config import cap_of
from vllm_kv_cache_limit.hooks.devices import instance_devices
from vllm_kv_cache_limit.hooks.runtime import autoscaler
from vllm_kv_cache_limit.hooks.runtime.autoscaler import Autoscaler
from vllm_kv_cache_limit.logic import autoscale_policy, startup_lock
from vllm_kv_cache_limit.logic.budget_ledger import Ledger, LedgerBusy, View, others_in
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError
from vllm_kv_cache_limit.logic.limit_math import Allocation
from vllm_kv_cache_limit.logic.sizes import format_size, suggest_size

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")

JOIN_TIMEOUT_S = 120.0
"""Seconds a starting instance waits for the others to give back its floor."""
LEDGER_WAIT_S = 30.0
"""Seconds one transaction of the join waits for the ledgers' locks (within
``JOIN_TIMEOUT_S``): a peer's transaction holds them for milliseconds."""


@dataclass
class Reservation:
    """A starting instance's entries in its devices' ledgers, holding its
    whole start-up allocation from before vLLM commits it until the join
    (``join``) rewrites them to what its workers still commit."""

    budget: int
    holds: int
    """Bytes each entry holds: the cap, over this instance's workers on a device."""
    ledgers: dict[str, Ledger] = field(default_factory=dict)
    """By device key."""
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    """The instance's id in its entries (``Autoscaler.instance``)."""

    def take(self, key: str) -> Ledger | None:
        """The ledger of device ``key``, handed over to the autoscaler."""
        return self.ledgers.pop(key, None)

    def close(self) -> None:
        """Leave the ledgers not handed over."""
        ledgers, self.ledgers = self.ledgers, {}
        for ledger in ledgers.values():
            ledger.close()


def reserve(vllm_config: Any, folder: str | None = None) -> Reservation | None:
    """With a shared budget, before vLLM allocates the KV cache: an entry
    in every device's ledger holding the start-up allocation (the cap,
    over this instance's workers there), so that the ledger never says less
    than the workers commit and no other instance grows into that memory.
    Written at once, over the budget if need be: vLLM commits the whole
    allocation to start (a cap may be above the budget), the device's
    start-up gate has checked the memory is free, and the others give back
    what they hold above their wish while the budget is over-committed.
    Refuses a budget that differs from the others'. None without one."""
    cache_config = vllm_config.cache_config
    budget, cap = getattr(cache_config, autoscaler.SHARED_BUDGET, None), cap_of(cache_config)
    if not getattr(cache_config, autoscaler.AUTOSCALE, False) or budget is None or cap is None:
        return None
    from vllm.platforms import current_platform

    found, workers = instance_devices(vllm_config)
    devices = sorted({(d.key, d.label) for d in found})
    # The cap as one block: its bytes on a device, over this instance's workers there.
    whole = Allocation(num_blocks=1, bytes_per_block=cap, blocks_per_request=1, max_model_len=1)
    holds = autoscale_policy.device_bytes_per_block(whole, len(devices), workers, current_platform.is_cpu())
    reservation = Reservation(budget=budget, holds=holds)
    folder = startup_lock.lock_dir() if folder is None else folder
    where = ", ".join(label for _, label in devices)
    try:
        for key, _ in devices:
            reservation.ledgers[key] = Ledger(folder, key, budget=budget)
        record = {"instance": reservation.instance, "budget": budget, "floor": 0, "holds": holds, "wants": 0}
        deadline = time.monotonic() + LEDGER_WAIT_S
        with contextlib.ExitStack() as stack:
            views = [
                stack.enter_context(ledger.transaction(max(0.0, deadline - time.monotonic())))
                for ledger in reservation.ledgers.values()
            ]
            others = others_in(views)
            _check_others(budget, 0, others, devices)
            for view in views:
                view.write(record)
    except (LedgerBusy, OSError) as exc:
        reservation.close()
        raise _unusable(exc, budget, where, folder) from None
    except BaseException:
        reservation.close()
        raise
    held = sum(int(o["holds"]) for o in others)
    logger.info(
        "KV cache autoscale: the start-up allocation, %s on %s, is reserved in the shared budget %s (the others "
        "hold %s)%s until this instance falls to its floor.",
        format_size(holds),
        where,
        format_size(budget),
        format_size(held),
        "; the budget is over-committed, and no other instance grows" if holds + held > budget else "",
    )
    return reservation


def leave_after_failure(engine_core: Any, reservation: Reservation) -> None:
    """A start-up that failed holding a reservation: an engine core process
    exits, and the kernel drops its entries with it, as its workers' memory
    goes (the ledger never says less than they commit); an in-process
    engine core's process goes on, so its entries leave now."""
    from vllm.v1.engine.core import EngineCoreProc

    if not isinstance(engine_core, EngineCoreProc):
        reservation.close()


def _unusable(exc: Exception, budget: int, where: str, folder: str) -> KVCacheMaxMemoryError:
    """The error of a ledger that cannot be used: its lock held by another
    process, or the folder refused (a planted link, no sticky bit)."""
    if isinstance(exc, LedgerBusy):
        return KVCacheMaxMemoryError(
            f"--kv-cache-shared-budget {format_size(budget)}: this instance could not join the ledger of "
            f"{where}: {exc}. A transaction holds that lock for milliseconds, "
            "so its holder is stopped or is not an instance: resume or end it, or give the instances of the "
            f"budget a lock folder only they may use ({startup_lock.LOCK_DIR_ENV})."
        )
    return KVCacheMaxMemoryError(
        f"--kv-cache-shared-budget: the ledger in {folder} cannot be used: {exc}. "
        f"Give a lock folder every instance of the budget may write to "
        f"({startup_lock.LOCK_DIR_ENV}): one created with mode 1777 for every user of the device, "
        "or a group's folder of mode 2770 for the members of that group."
    )


def join(
    scaler: Autoscaler,
    devices: list[tuple[str, str]],
    folder: str | None = None,
    committed: Callable[[], int] | None = None,
    reservation: Reservation | None = None,
) -> None:
    """Take this instance's place in every device's ledger, refusing a
    budget that differs from the others' or that cannot hold every floor,
    and wait (bounded) until the others leave this instance its floor.
    ``committed``: the blocks its workers hold now (read at each try):
    its entry holds them from its first write, so that the ledger never
    says less than the device holds, and the others, over the budget,
    give back until it fits (None: the entry holds nothing until the
    floor is free). No wait is unbounded: a ledger lock another process
    keeps fails the join within ``LEDGER_WAIT_S`` (and ``JOIN_TIMEOUT_S``),
    naming it and its holder, so that the start-up lock this instance holds
    is released. ``reservation``: this instance's entries from ``reserve``,
    rewritten by the first write (any of a device not joined leave after
    it), so that no instant sees the ledger without them."""
    assert scaler.budget is not None
    folder = startup_lock.lock_dir() if folder is None else folder
    floor = scaler.floor * scaler.unit  # on each device, over this instance's workers there
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    scaler.hysteresis.target = scaler.floor
    try:
        if reservation is not None:
            scaler.instance = reservation.instance
        for key, label in sorted(set(devices)):
            taken = None if reservation is None else reservation.take(key)
            scaler.ledgers.append(taken or Ledger(folder, key, budget=scaler.budget))
            scaler.devices.append(label)
        while True:
            with _transaction(scaler, deadline) as views:
                scaler.others = others_in(views)
                _check_others(
                    scaler.budget, floor, scaler.others, devices, scaler.unit >= 2 * scaler.allocation.bytes_per_block
                )
                free = scaler.budget - max((sum(int(o["holds"]) for o in view.others) for view in views), default=0)
                if committed is not None:
                    scaler.held = max(scaler.floor, committed())
                    fits = free >= scaler.held_blocks * scaler.unit
                else:
                    fits = free >= floor
                    scaler.held = scaler.floor if fits else 0
                scaler._write(views)
            if reservation is not None:
                reservation.close()
            if fits:
                return
            if time.monotonic() > deadline:
                holders = ", ".join(f"{o.get('label')} ({format_size(int(o['holds']))})" for o in scaler.others)
                raise KVCacheMaxMemoryError(
                    f"--kv-cache-shared-budget {format_size(scaler.budget)}: the other instances on "
                    f"{', '.join(label for _, label in devices)} hold it ({holders}) and did not leave this "
                    f"instance its --kv-cache-min-memory {format_size(floor)} within {JOIN_TIMEOUT_S:g} s. "
                    "Start it when they are idle, or give a larger budget."
                )
            time.sleep(0.2)
    except (LedgerBusy, OSError) as exc:  # a planted link, a folder without the sticky bit, another user's folder
        scaler.close()
        raise _unusable(exc, scaler.budget, ", ".join(label for _, label in devices), folder) from None
    except BaseException:
        scaler.close()
        raise


@contextlib.contextmanager
def _transaction(scaler: Autoscaler, deadline: float) -> Iterator[list[View]]:
    """Every device's ledger under its lock, all of them waited for within
    ``LEDGER_WAIT_S`` together, and no later than ``deadline``."""
    until = min(time.monotonic() + LEDGER_WAIT_S, max(deadline, time.monotonic()))
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(ledger.transaction(max(0.0, until - time.monotonic()))) for ledger in scaler.ledgers]


def _check_others(
    total: int, floor: int, others: list[dict[str, Any]], devices: list[tuple[str, str]], workers: bool = False
) -> None:
    """Refuse a budget that differs from the others' or cannot hold every
    floor; ``workers``: this instance has several workers on a device, and
    ``floor`` is theirs together."""
    where = ", ".join(label for _, label in devices)
    for other in others:
        if other.get("budget") != total:
            raise KVCacheMaxMemoryError(
                f"--kv-cache-shared-budget {format_size(total)} ({total} bytes) differs from the "
                f"{format_size(int(other.get('budget') or 0))} ({other.get('budget')} bytes) that {other.get('label')} "
                f"gave for {where}; every instance sharing a device must give the same budget."
            )
    floors = [int(o["floor"]) for o in others]
    if not autoscale_policy.fits_floors(floor, floors, total):
        least = floor + sum(floors)
        mine = f"this one's {format_size(floor)}" + (" (its workers' floors on the device together)" if workers else "")
        theirs = (
            f" and {len(others)} other(s)' {format_size(sum(floors))} ({', '.join(str(o.get('label')) for o in others)})"
            if others
            else ""
        )
        raise KVCacheMaxMemoryError(
            f"--kv-cache-shared-budget {format_size(total)} ({total} bytes) is below the floors of the "
            f"instances on {where}: {mine}{theirs}. Give a budget of at "
            f"least {suggest_size(least)} ({least} bytes), or lower --kv-cache-min-memory."
        )


def stop(scaler: Autoscaler, lock: threading.RLock | None, wait_s: float) -> bool:
    """Stop the autoscaler before the engine core shuts down; whether no
    decision is in progress, so that the caller may leave its ledgers
    (``scaler.close()``) once the workers' memory is gone: the entries go
    after the memory they count, never before. An in-process engine core's
    timer may be deciding (vLLM's finalizer calls shutdown without the
    client's lock, ``lock``): it starts no other decision, and this one may
    end within ``wait_s``. One that does not keeps its ledger's descriptors
    (it may still write through them), and the timer closes them as it
    ends."""
    scaler.stop.set()
    if lock is None:
        return True
    if lock.acquire(timeout=wait_s):
        lock.release()  # no decision starts after ``stop``
        return True
    scaler.close_when_stopped = True
    timer = scaler.timer
    if timer is not None:
        timer.join(timeout=0.5)
    if timer is None or not timer.is_alive():
        return True
    logger.warning(
        "An autoscaling decision is still in progress after %g s; the engine core shuts down, and its shared "
        "budget's ledger entries go when the decision ends (or the process exits).",
        wait_s,
    )
    return False
