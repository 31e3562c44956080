"""A GGUF file's metadata and tensor index, parsed in one pass (llama.cpp's format, version 2-3).

``gguf.GGUFReader`` builds a numpy view for every part of every metadata value: for SmolLM2's
49k vocabulary strings and 49k merges that is ~1.3M views, 2.4 s of parsing (a first start of
the packaged model took 5.3 s with it, 2.6 s with this parser, on this project's 2-core
machine). This reader decodes each value straight into Python (strings one ``unpack_from`` and
one slice each; arrays of numbers one ``frombuffer``) and keeps the tensor payloads
memory-mapped, as that reader does: 0.05 s for the same file. Little-endian files only (what
llama.cpp writes on every platform it runs on).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
#: ggml's tensors have at most four dimensions; more is a damaged index
MAX_DIMS = 4
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

#: GGUF metadata value types (``gguf.GGUFValueType``) with fixed sizes: struct code, numpy type
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "<u1"), 1: ("b", "<i1"), 2: ("H", "<u2"), 3: ("h", "<i2"), 4: ("I", "<u4"), 5: ("i", "<i4"),
    6: ("f", "<f4"), 7: ("?", "<u1"), 10: ("Q", "<u8"), 11: ("q", "<i8"), 12: ("d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7

#: tensor types stored as plain numbers (``gguf.GGMLQuantizationType``): numpy type
_PLAIN_TENSORS: dict[int, str] = {0: "<f4", 1: "<f2", 24: "<i1", 25: "<i2", 26: "<i4", 27: "<i8", 28: "<f8"}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: llama.cpp's name (``blk.0.attn_q.weight``).
        tensor_type: its ``gguf.GGMLQuantizationType`` value.
        shape: ggml's order, fastest-varying dimension first (reversed from torch's).
        data: the payload, memory-mapped: plain types as their numbers in torch's order,
            quantized ones as bytes (rows of whole quantization blocks), as ``gguf.GGUFReader``
            gives them to ``gguf.quants.dequantize``.
    """

    name: str
    tensor_type: int
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """A parsed GGUF file: :attr:`fields` (metadata, decoded) and :attr:`tensors` (index and
    memory-mapped payloads).

    Args:
        path: the ``.gguf`` file.

    Raises:
        ValueError: not a GGUF file, an unsupported version or byte order, or a file cut short
            or corrupt (naming what was being read).
    """

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._pos = 0
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        try:
            version, n_tensors, n_fields = struct.unpack_from("<IQQ", self._buf, 4)
        except struct.error:
            raise ValueError("the header is cut short") from None
        if version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ValueError(f"GGUF version {version} is not supported{hint}")
        self._pos = 24
        #: metadata: strings, numbers, bools, lists of them
        self.fields: dict[str, Any] = {}
        try:
            for _ in range(n_fields):
                key = self._string()
                if key in self.fields:
                    raise ValueError(f"metadata key {key!r} appears twice")
                self.fields[key] = self._value(self._unpack("<I"))
            infos = [self._tensor_info() for _ in range(n_tensors)]
        except (struct.error, UnicodeDecodeError, IndexError, RecursionError) as exc:
            raise ValueError(f"the metadata is corrupt or cut short at byte {self._pos} ({exc})") from None
        names = [info[0] for info in infos]
        if len(set(names)) != len(names):
            raise ValueError(f"tensor {next(n for n in names if names.count(n) > 1)!r} appears twice")
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")
        data_start = -(-self._pos // alignment) * alignment
        payload = np.frombuffer(self._map, dtype=np.uint8)
        #: every tensor, in the file's order
        self.tensors: list[GGUFTensor] = [self._tensor(payload, data_start, *info) for info in infos]

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` where the file has none."""
        return self.fields.get(key, default)

    # -- parsing ---------------------------------------------------------------------------
    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._buf, self._pos)
        start = self._pos + 8
        if start + length > len(self._buf):
            raise IndexError("a string runs past the end of the file")
        self._pos = start + length
        return str(self._buf[start : self._pos], "utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = struct.unpack_from("<IQ", self._buf, self._pos)
            self._pos += 12
            if item_kind in _SCALARS:
                dtype = np.dtype(_SCALARS[item_kind][1])
                end = self._pos + count * dtype.itemsize
                if end > len(self._buf):
                    raise IndexError("an array runs past the end of the file")
                values = np.frombuffer(self._buf[self._pos : end], dtype=dtype)
                self._pos = end
                return [bool(v) for v in values] if item_kind == _BOOL else values.tolist()
            if item_kind == _STRING:
                return self._strings(count)
            return [self._value(item_kind) for _ in range(count)]
        scalar = _SCALARS.get(kind)
        if scalar is None:
            raise ValueError(f"the metadata holds a value of unknown type {kind} at byte {self._pos}")
        value = self._unpack("<" + scalar[0])
        return bool(value) if kind == _BOOL else value

    def _strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary): the loop ``_string`` runs, inlined."""
        buf, pos, out = self._buf, self._pos, []
        unpack, size = struct.Struct("<Q").unpack_from, len(buf)
        for _ in range(count):
            (length,) = unpack(buf, pos)
            pos += 8
            if pos + length > size:
                raise IndexError("a string runs past the end of the file")
            out.append(str(buf[pos : pos + length], "utf-8"))
            pos += length
        self._pos = pos
        return out

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._unpack("<I")
        if n_dims > MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
        shape = struct.unpack_from(f"<{n_dims}Q", self._buf, self._pos)
        self._pos += 8 * n_dims
        tensor_type, offset = struct.unpack_from("<IQ", self._buf, self._pos)
        self._pos += 12
        return name, tuple(shape), tensor_type, offset

    def _tensor(self, payload: np.ndarray, data_start: int, name: str, shape: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        torch_order = tuple(reversed(shape))
        count = math.prod(shape)  # Python ints: a damaged dimension cannot overflow
        start = data_start + offset
        plain = _PLAIN_TENSORS.get(kind)
        if plain is not None:
            dtype = np.dtype(plain)
            nbytes = count * dtype.itemsize
            view_shape = torch_order
        else:
            try:
                quant = GGMLQuantizationType(kind)
                block, block_bytes = GGML_QUANT_SIZES[quant]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name!r} has an unknown type {kind}") from None
            if not shape or shape[0] % block:
                raise ValueError(f"tensor {name!r}: its rows of {shape[0] if shape else 0} are not whole blocks of {block}")
            nbytes = count // block * block_bytes
            dtype = np.dtype(np.uint8)
            view_shape = quant_shape_to_byte_shape(torch_order, quant)
        if start + nbytes > payload.size:
            raise ValueError(f"tensor {name!r} runs past the end of the file (the file is cut short)")
        data = payload[start : start + nbytes].view(dtype).reshape(view_shape)
        return GGUFTensor(name, kind, shape, data)


__all__ = ["GGUFFile", "GGUFTensor"]
