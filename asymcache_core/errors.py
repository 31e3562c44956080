"""Errors the engine raises that callers handle by kind."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot run any more steps (a tensor-parallel rank died, say): every request in
    flight fails with it, and so does every later step. A server answers 503."""
