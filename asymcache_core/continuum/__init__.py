"""Continuum: keep an agent job's KV across a tool pause for a time-to-live (TTL).

One decision class over two pin mechanisms, below the runtime so that both the embedded engine
and the vLLM plugin use it:

* :mod:`~asymcache_core.continuum.estimator`: per-tool duration distributions.
* :mod:`~asymcache_core.continuum.ttl`: the TTL rule (``TTLRule``, :func:`~.ttl.choose_ttl`,
  the pin benefit), memoryfulness and the queueing-delay tracker.
* :mod:`~asymcache_core.continuum.controller`: :class:`~.controller.ContinuumController`, the
  decisions (reload cost, TTL, hints, program-level admission order).
* :mod:`~asymcache_core.continuum.ttft_target`: :class:`~.ttft_target.TTFTTarget`, how far
  program order may move a request ahead of its arrival under a time-to-first-token target.
* :mod:`~asymcache_core.continuum.backends`: the :class:`~.backends.PinBackend` protocol and the
  embedded engine's :class:`~.backends.PinManager`; the vLLM plugin's
  :class:`~asymcache_core.integrations.vllm.pins.PinSet` is the other backend.
"""
