"""The simulator's output beside its table: a timeline PNG per scenario and
a progress bar on stderr.

The timeline shows, per instance (one panel each), its limit, the blocks
it holds, its demand (held blocks plus those its waiting requests' prompts
need) and its waiting queue, from the points the instance sampled
(``Instance.timeline``, one per ``SAMPLE_S`` of the virtual clock at most).
matplotlib (``Agg``, no display) and tqdm are imported only when asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class PlotError(ValueError):
    """The plot cannot be written; the message says what would work."""


def plot_path(base: str, scenario: str) -> Path:
    """``base`` with the scenario before its suffix: ``out.png`` -> ``out-autoscale.png``."""
    path = Path(base)
    return path.with_name(f"{path.stem}-{scenario}{path.suffix or '.png'}")


def write_timeline(result: dict[str, Any], path: Path) -> Path | None:
    """One scenario's timelines as a PNG at ``path``: per instance its limit,
    held blocks and demand (blocks, left axis) and waiting requests (right
    axis). None, and no file, when no instance of it started."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install matplotlib") from None
    timelines: dict[str, list[tuple[float, ...]]] = result["timelines"]
    names = [n for n in result["instances"] if n in timelines]
    if not names:
        return None  # no instance started: nothing to draw
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.6 * len(names)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        points = timelines[name]
        times = [p[0] for p in points]
        ax.step(times, [p[1] for p in points], where="post", label="limit")
        ax.plot(times, [p[2] for p in points], label="held")
        if all(p[4] is not None for p in points):  # summed only when the run was told it plots
            ax.plot(times, [p[2] + p[4] for p in points], label="demand", linestyle="--")
        ax.set_ylabel(f"{name}\nblocks")
        queue = ax.twinx()
        queue.plot(times, [p[3] for p in points], color="grey", alpha=0.5, label="waiting")
        queue.set_ylabel("waiting")
        ax.legend(loc="upper left", fontsize="small")
    axes[-1, 0].set_xlabel("seconds (virtual clock)")
    fig.suptitle(f"{result['scenario']}: goodput {result['goodput_req_s']:.2f} req/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def progress_bar(
    scenario: str, total_s: float, force: bool
) -> tuple[Callable[[float], None] | None, Callable[[], None]]:
    """A tqdm bar on stderr of simulated seconds over ``total_s`` (when stderr
    is a terminal, or ``force``): its update callback and its close."""
    if not (force or sys.stderr.isatty()):
        return None, lambda: None
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar = tqdm(total=round(total_s, 1), desc=scenario, unit="s", file=sys.stderr, leave=False)

    def update(now: float) -> None:
        bar.update(round(min(now, total_s), 1) - bar.n)

    return update, bar.close
