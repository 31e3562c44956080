"""What a full garbage collection costs a server, before and after its start-up heap is frozen.

Builds the runtime and app ``asymcache serve`` builds (the default model on this machine), then
times ``gc.collect()`` five times before and five times after
:func:`agent_runtime.server.app.freeze_startup_heap`, and prints one line each (milliseconds,
sorted). A full collection holds the GIL, so every thread (the engine's steps included) waits
for it.

Usage::

    python scripts/bench_gc_freeze.py
"""

from __future__ import annotations

import gc
import time

from agent_runtime.server.app import ServeOptions, freeze_startup_heap


def _full_collection_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    options = ServeOptions()
    runtime = options.build_runtime()
    options.build_app(lambda: runtime)
    try:
        gc.collect()
        print(f"tracked objects: {len(gc.get_objects())}")
        before = sorted(_full_collection_ms() for _ in range(5))
        frozen = freeze_startup_heap()
        after = sorted(_full_collection_ms() for _ in range(5))
        print(f"full collection, ms: before the freeze {', '.join(f'{t:.2f}' for t in before)}")
        print(f"full collection, ms: after freezing {frozen} objects {', '.join(f'{t:.3f}' for t in after)}")
    finally:
        gc.unfreeze()
        runtime.close_sync()


if __name__ == "__main__":
    main()
