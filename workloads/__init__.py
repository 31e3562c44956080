"""Agent workloads: trace schema, synthetic generators, arrival processes, importers.

Pure Python (pydantic, numpy, stdlib); imports nothing from the engine or runtime packages.

Typical use::

    from workloads import generate, poisson, job_token_stream
    trace = poisson(generate("swe", num_jobs=200, seed=0, token_scale=0.05), rate=0.5, seed=0)
    ids = job_token_stream(trace.jobs[0], vocab_size=49152, seed=0)
"""

from __future__ import annotations

from workloads.arrivals import (
    ClosedLoopDispatcher,
    apply_arrivals,
    burst,
    closed_loop,
    poisson,
    zero,
)
from workloads.generator_params import (
    ChatParams,
    CommonParams,
    SweParams,
    ToolLoopParams,
    ToolProfile,
)
from workloads.generators import (
    WORKLOADS,
    generate,
    generate_chat,
    generate_swe,
    generate_toolloop,
    make_params,
)
from workloads.importers import (
    IMPORTERS,
    JsonStream,
    estimate_tokens,
    import_bailian,
    import_bfcl,
    import_mooncake,
    import_sharegpt,
    load_trace,
)
from workloads.schema import (
    ArrivalInfo,
    Job,
    Trace,
    TraceError,
    Turn,
)
from workloads.token_streams import job_token_stream, stable_seed
from workloads.trace_stats import TraceStats

__all__ = [
    "IMPORTERS",
    "WORKLOADS",
    "ArrivalInfo",
    "ChatParams",
    "ClosedLoopDispatcher",
    "CommonParams",
    "Job",
    "JsonStream",
    "SweParams",
    "ToolLoopParams",
    "ToolProfile",
    "Trace",
    "TraceError",
    "TraceStats",
    "Turn",
    "apply_arrivals",
    "burst",
    "closed_loop",
    "estimate_tokens",
    "generate",
    "generate_chat",
    "generate_swe",
    "generate_toolloop",
    "import_bailian",
    "import_bfcl",
    "import_mooncake",
    "import_sharegpt",
    "job_token_stream",
    "load_trace",
    "make_params",
    "poisson",
    "stable_seed",
    "zero",
]
