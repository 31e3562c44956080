"""The embedded engine: ``from asymcache_core import Engine, EngineConfig, SamplingParams``."""

from __future__ import annotations

from asymcache_core.config import EngineConfig
from asymcache_core.engine import Engine
from asymcache_core.engine_stats import CacheReset, CompletionOutput, EngineStats, GenerationOutput
from asymcache_core.errors import EngineDeadError
from asymcache_core.request import RequestOutput
from asymcache_core.sampling_params import SamplingParams

__all__ = [
    "CacheReset", "CompletionOutput", "Engine", "EngineConfig", "EngineDeadError", "EngineStats", "GenerationOutput",
    "RequestOutput", "SamplingParams",
]
