"""Fixtures of the kernel tests: the Triton kernels under the interpreter (CPU) or compiled (GPU).

The interpreter is chosen when a ``@triton.jit`` function is decorated, so the interpreted
kernels are a fresh copy of the kernel module loaded under another module name while
``TRITON_INTERPRET=1`` is set, with fresh copies of the kernel modules it imports jitted helpers
from (``kernels.msa_walk``...); whatever imported those modules before is left untouched.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

_KERNELS = Path(__file__).resolve().parents[2] / "kernels"
#: kernel modules that define jitted functions (one kernel module may import another's helpers)
_JIT_MODULES = tuple(sorted(p.stem for p in _KERNELS.glob("*.py") if "@triton.jit" in p.read_text()))


def _load_fresh(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _triton_python_modules() -> dict[str, ModuleType]:
    """Triton's Python modules (its compiled extension ``triton._C`` excluded)."""
    return {
        name: mod
        for name, mod in sys.modules.items()
        if (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")
    }


def _interpreted(file: str) -> Iterator[ModuleType]:
    """``kernels/<file>`` decorated under Triton's interpreter (CPU tensors).

    Triton's own ``@jit`` helpers (``tl.zeros``, ``tl.cdiv``...) are decorated when triton is
    imported, so the interpreter needs triton imported while ``TRITON_INTERPRET=1``. Usually
    nothing imported triton before this fixture on a CPU machine; if something did, its Python
    modules (not the compiled extension) are set aside and imported afresh, and put back after.
    On CUDA machines the compiled kernels are tested instead (``-m gpu``).
    """
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: the compiled kernels are tested by the gpu tests")
    saved: dict[str, ModuleType] = {}
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        saved = _triton_python_modules()
        for name in saved:
            del sys.modules[name]
    name = f"kernels._{Path(file).stem}_interpreted"
    # NOTE: the module's own imports of other kernel modules must decorate them afresh too (a
    # compiled helper cannot run inside an interpreted kernel): they are set aside, package
    # attributes included, and put back after.
    package = importlib.import_module("kernels")
    missing = object()
    jit_modules = {stem: (sys.modules.pop(f"kernels.{stem}", None), getattr(package, stem, missing)) for stem in _JIT_MODULES}
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            yield _load_fresh(_KERNELS / file, name)
    finally:
        sys.modules.pop(name, None)
        for stem, (module, attribute) in jit_modules.items():
            sys.modules.pop(f"kernels.{stem}", None)
            if module is not None:
                sys.modules[f"kernels.{stem}"] = module
            if attribute is missing:
                package.__dict__.pop(stem, None)
            else:
                setattr(package, stem, attribute)
        if saved:
            for fresh in _triton_python_modules():
                del sys.modules[fresh]
            sys.modules.update(saved)


def _compiled(file: str) -> ModuleType:
    """``kernels.<module>`` compiled for the GPU."""
    module_name = f"kernels.{Path(file).stem}"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        if module_name in sys.modules:
            return _load_fresh(_KERNELS / file, f"kernels._{Path(file).stem}_compiled")
        return importlib.import_module(module_name)


@pytest.fixture(scope="module")
def interp() -> Iterator[ModuleType]:
    """``kernels/msa_triton.py`` under the interpreter."""
    yield from _interpreted("msa_triton.py")


@pytest.fixture(scope="module")
def compiled() -> ModuleType:
    """``kernels.msa_triton`` compiled for the GPU."""
    return _compiled("msa_triton.py")


@pytest.fixture(scope="module")
def interp_store() -> Iterator[ModuleType]:
    """``kernels/kv_store_triton.py`` under the interpreter."""
    yield from _interpreted("kv_store_triton.py")


@pytest.fixture(scope="module")
def compiled_store() -> ModuleType:
    """``kernels.kv_store_triton`` compiled for the GPU."""
    return _compiled("kv_store_triton.py")


@pytest.fixture(scope="module")
def interp_dense() -> Iterator[ModuleType]:
    """``kernels/batch_invariant.py`` under the interpreter."""
    yield from _interpreted("batch_invariant.py")


@pytest.fixture(scope="module")
def compiled_dense() -> ModuleType:
    """``kernels.batch_invariant`` compiled for the GPU."""
    return _compiled("batch_invariant.py")


@pytest.fixture(scope="module")
def interp_fused() -> Iterator[ModuleType]:
    """``kernels/fused.py`` under the interpreter."""
    yield from _interpreted("fused.py")


@pytest.fixture(scope="module")
def compiled_fused() -> ModuleType:
    """``kernels.fused`` compiled for the GPU."""
    return _compiled("fused.py")


@pytest.fixture(scope="module")
def interp_copy() -> Iterator[ModuleType]:
    """``kernels/block_copy.py`` under the interpreter."""
    yield from _interpreted("block_copy.py")


@pytest.fixture(scope="module")
def compiled_copy() -> ModuleType:
    """``kernels.block_copy`` compiled for the GPU."""
    return _compiled("block_copy.py")


@pytest.fixture(scope="module")
def interp_sampling() -> Iterator[ModuleType]:
    """``kernels/sampling.py`` under the interpreter."""
    yield from _interpreted("sampling.py")


@pytest.fixture(scope="module")
def compiled_sampling() -> ModuleType:
    """``kernels.sampling`` compiled for the GPU."""
    return _compiled("sampling.py")


@pytest.fixture(scope="module")
def interp_top_p() -> Iterator[ModuleType]:
    """``kernels/top_p.py`` under the interpreter."""
    yield from _interpreted("top_p.py")


@pytest.fixture(scope="module")
def compiled_top_p() -> ModuleType:
    """``kernels.top_p`` compiled for the GPU."""
    return _compiled("top_p.py")
