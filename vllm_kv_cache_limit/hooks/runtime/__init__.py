"""Run-time resize's vLLM glue, split as ``hooks.cap`` is: block pool, engine
core, worker, client (the public Python API) and server. Every hook here is
optional (``availability``); the arithmetic is in ``resize``.
"""
