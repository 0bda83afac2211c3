"""``python -m vllm_kv_cache_limit.plan``: the same as ``vllm-kv-plan``."""

import sys

from vllm_kv_cache_limit.plan.cli import main

sys.exit(main())
