"""``--recommend``: a small search for the settings that serve the most
requests within the SLOs (total goodput) on the same traffic, and the
``vllm serve`` flags that give them.

Searched, at most ``MAX_RUNS`` runs of the simulation:

- static caps (``--kv-cache-max-memory`` each): the even split, and the
  budget split in proportion to each instance's tokens (prompt + output)
  in its traffic;
- the plugin's autoscaling with the shared budget: the hysteresis
  (``--shrink-after``) in ``SHRINK_AFTER_S``, the floors at the plugin's
  default (one request of ``max_model_len``) or at half the even share.

The budget itself is the one given (``--budget``); a larger one would fit
only what the device's memory allows, which ``--device-memory`` checks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_kv_cache_limit.logic.autoscale_policy import AUTOSCALE_FLAG, MIN_MEMORY_FLAG, SHARED_BUDGET_FLAG
from vllm_kv_cache_limit.logic.cap_decision import FLAG
from vllm_kv_cache_limit.logic.envs import SHRINK_AFTER_S as SHRINK_ENV
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError
from vllm_kv_cache_limit.logic.sizes import format_size, parse_size
from vllm_kv_cache_limit.sim import scenarios
from vllm_kv_cache_limit.sim.instance import SimulationError

SHRINK_AFTER_S = (2.0, 10.0, 30.0)
MAX_RUNS = 8


def _tidy(nbytes: int) -> int:
    """``nbytes`` rounded down to the size the flags print, so that what runs is what is recommended."""
    return parse_size(format_size(nbytes, "down"))


def _candidates(setup: scenarios.Setup) -> list[dict[str, Any]]:
    n, budget = len(setup.specs), setup.budget_bytes
    tokens = [sum(a.prompt_tokens + a.output_tokens for a in t) for t in setup.traffic]
    found: list[dict[str, Any]] = [{"kind": "static", "caps": [_tidy(budget // n)] * n, "label": "even split"}]
    if sum(tokens) and len(set(tokens)) > 1:
        caps = [_tidy(budget * t // sum(tokens)) for t in tokens]
        found.append({"kind": "static", "caps": caps, "label": "split by traffic tokens"})
    for floor in (None, _tidy(budget // (2 * n))):
        for shrink in SHRINK_AFTER_S:
            found.append({"kind": "autoscale", "floor": floor, "shrink_after_s": shrink,
                          "label": f"autoscale, floor {'default' if floor is None else format_size(floor)}, "
                                   f"shrink after {shrink:g} s"})  # fmt: skip
    return found[:MAX_RUNS]


def _run(setup: scenarios.Setup, candidate: dict[str, Any]) -> dict[str, Any]:
    if candidate["kind"] == "autoscale":
        variant = dataclasses.replace(
            setup, floors=[candidate["floor"]] * len(setup.specs), shrink_after_s=candidate["shrink_after_s"],
            progress=None,
        )  # fmt: skip
        return scenarios.run("autoscale", variant)
    return scenarios.run("static", dataclasses.replace(setup, static_caps=candidate["caps"], progress=None))


def recommend(setup: scenarios.Setup) -> dict[str, Any]:
    """Every candidate's total goodput and SLO attainment, and the best one with its flags."""
    tried = []
    for candidate in _candidates(setup):
        try:
            result = _run(setup, candidate)
        except (SimulationError, KVCacheMaxMemoryError) as exc:  # a cap or floor vLLM or the plugin refuses
            tried.append({**candidate, "refused": str(exc)})
            continue
        attained = [f["slo_attainment"] or 0.0 for f in result["instances"].values()]
        tried.append({**candidate, "goodput_req_s": result["goodput_req_s"], "slo_attainment_min": min(attained)})
    scored = [c for c in tried if "refused" not in c]
    if not scored:
        raise SimulationError("--recommend: every candidate was refused: " + "; ".join(c["refused"] for c in tried))
    best = max(scored, key=lambda c: (round(c["goodput_req_s"], 9), c["slo_attainment_min"]))
    return {"searched": tried, "best": best, "flags": flags(setup, best)}


def flags(setup: scenarios.Setup, best: dict[str, Any]) -> dict[str, str]:
    """Each instance's ``vllm serve`` command line for the ``best`` candidate."""
    lines = {}
    for index, spec in enumerate(setup.specs):
        head = f"vllm serve {spec.model} --max-model-len {spec.max_model_len} --block-size {spec.block_size}"
        if best["kind"] == "static":
            lines[spec.name] = f"{head} {FLAG} {format_size(best['caps'][index])}"
            continue
        budget = format_size(setup.budget_bytes, "down")
        floor = "" if best["floor"] is None else f" {MIN_MEMORY_FLAG} {format_size(best['floor'])}"
        lines[spec.name] = (f"{SHRINK_ENV}={best['shrink_after_s']:g} {head} {FLAG} {budget} {AUTOSCALE_FLAG} "
                            f"{SHARED_BUDGET_FLAG} {budget}{floor}")  # fmt: skip
    return lines


def format_recommendation(found: dict[str, Any]) -> str:
    """The search's lines, then the recommended commands."""
    lines = [f"recommendation: searched {len(found['searched'])} settings (goodput req/s, least SLO attainment)"]
    for c in found["searched"]:
        mark = "*" if c is found["best"] else " "
        if "refused" in c:
            lines.append(f" {mark} {c['label']:<52} refused: {c['refused']}")
        else:
            lines.append(f" {mark} {c['label']:<52} {c['goodput_req_s']:7.2f} {c['slo_attainment_min']:6.0%}")
    lines.append("recommended (one command per instance):")
    lines.extend(f"  {name}: {command}" for name, command in found["flags"].items())
    return "\n".join(lines)
