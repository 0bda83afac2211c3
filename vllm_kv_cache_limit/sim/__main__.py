"""``python -m vllm_kv_cache_limit.sim``: the same as ``vllm-kv-sim``."""

from vllm_kv_cache_limit.sim import main

raise SystemExit(main())
