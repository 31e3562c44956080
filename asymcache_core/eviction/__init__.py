"""Eviction policies: one protocol (:mod:`.base`), one small module per policy."""

from __future__ import annotations

from asymcache_core.eviction.base import (
    EvictionPolicy,
    KeyedPolicy,
    PolicyContext,
    create_policy,
    policy_registry,
    registered_policies,
)

__all__ = [
    "EvictionPolicy",
    "KeyedPolicy",
    "PolicyContext",
    "create_policy",
    "policy_registry",
    "registered_policies",
]
