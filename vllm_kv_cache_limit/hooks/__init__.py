"""Everything that patches vLLM: ``cap`` (the start-up cap) and ``runtime``
(the run-time limit: resize, autoscaling), one module per vLLM module they
patch, with the helpers both use (``wrap``, ``apply``, ``devices``)."""
