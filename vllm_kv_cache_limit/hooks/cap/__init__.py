"""The cap's vLLM glue: one module per vLLM module it patches, each with its
``patch``, its wrappers and its ``Hook`` entries (see ``compat.registry``).
"""
