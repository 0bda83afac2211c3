"""``vllm-kv-sim``: several vLLM instances sharing one device, replayed on
traffic with vLLM's real scheduler and this plugin's real run-time limit,
autoscaler and shared-budget ledger, on a virtual clock; only the executor
is replaced by a step-time model. See docs/simulate.md.

Nothing in the plugin imports this package (an import contract); vLLM is
imported only once a simulation is set up, so ``--help`` is quick.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The console script ``vllm-kv-sim``."""
    from vllm_kv_cache_limit.sim.cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]
