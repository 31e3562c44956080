"""Integrations of AsymCache's policies into other serving engines (``vllm``)."""

from __future__ import annotations
