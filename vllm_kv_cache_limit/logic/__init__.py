"""Pure logic: sizes, the cap decision, the run-time limit's arithmetic, the
autoscaling policy, the shared budget's ledger, the start-up lock. No module
here imports vLLM or the hooks (an import contract, ``make lint``), so each
is tested without an engine."""
