"""A GGUF file's header, read as fast as placement needs it: every key-value, with long arrays
(the vocabulary...) skipped and only their length kept, and the count of tensors of each type.

The ``gguf`` package's definitions (magic, value types, quantization types) are used, not
``gguf.GGUFReader``: it turns every element of every array into numpy objects, slow for a large
vocabulary (Gemma 3 has 262,144 strings; docs/models.md has the figures). A test checks this
parser against ``GGUFReader`` field by field."""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

# Arrays up to this many elements are kept (per-layer head counts, languages, tags); longer
# ones (vocabulary, scores, merges) are skipped and only their length is kept.
_MAX_KEPT_ARRAY = 4096

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


class GgufError(ValueError):
    """The file is not a GGUF model that can be read (not GGUF, truncated, no layers...)."""


class GgufTruncated(GgufError):
    """The bytes end before the header does (a file cut short, or the first bytes of one)."""


def read_gguf_fields(path: Path | str) -> dict[str, Any]:
    """Every key-value of the GGUF header, as Python values; arrays longer than 4096 elements
    (the vocabulary...) are ``SkippedArray`` with their length."""
    return read_header(Path(path))[0]


def read_header(p: Path) -> tuple[dict[str, Any], Counter[str]]:
    if not p.is_file():
        raise GgufError(f"{p}: no such file" if not p.exists() else f"{p}: not a file")
    size = p.stat().st_size
    if size < 24:
        raise GgufError(f"{p} is not a GGUF file (only {size} bytes)")
    with p.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return parse_gguf_header(mm, str(p))


def parse_gguf_header(buf: bytes | mmap.mmap, name: str) -> tuple[dict[str, Any], Counter[str]]:
    """The key-values and tensor types of the GGUF header at the start of ``buf``: the whole
    file, or its first bytes (``GgufTruncated`` when they end before the header does)."""
    try:
        return _Header(buf, name).read()
    except GgufError:
        raise
    except struct.error as exc:  # a read past the end of the bytes
        raise GgufTruncated(f"{name}: truncated GGUF header ({exc})") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise GgufError(f"{name}: damaged GGUF header ({exc})") from exc


@dataclass(frozen=True)
class SkippedArray:
    """A long array that was skipped: only its length is known."""

    length: int


class _Header:
    """Reads GGUF v2/v3 key-values and tensor infos from a memory map (or the first bytes)."""

    def __init__(self, buf: bytes | mmap.mmap, path: str) -> None:
        self.buf = buf
        self.path = path
        self.pos = 0
        self.order = "<"

    def read(self) -> tuple[dict[str, Any], Counter[str]]:
        (magic,) = struct.unpack_from("<I", self.buf, 0)
        if magic != GGUF_MAGIC:
            raise GgufError(
                f"{self.path} is not a GGUF file (it starts with {bytes(self.buf[:4])!r},"
                " a GGUF file starts with b'GGUF')"
            )
        (version,) = struct.unpack_from("<I", self.buf, 4)
        if version & 0xFFFF == 0:  # written on a big-endian machine, as GGUFReader detects it
            self.order = ">"
            (version,) = struct.unpack_from(">I", self.buf, 4)
        if version not in (2, 3):
            raise GgufError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        self.pos = 8
        n_tensors = self._scalar("Q")
        n_kv = self._scalar("Q")
        kv: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            kv[key] = self._value(GGUFValueType(self._scalar("I")))
        kv["GGUF.tensor_count"] = n_tensors
        tensor_types: Counter[str] = Counter()
        for _ in range(n_tensors):
            self._skip_string()
            n_dims = self._scalar("I")
            self.pos += 8 * n_dims
            tensor_types[_type_name(self._scalar("I"))] += 1
            self.pos += 8  # data offset
        if self.pos > len(self.buf):
            raise GgufTruncated(f"{self.path}: truncated GGUF header")
        return kv, tensor_types

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("Q")
        if self.pos + n > len(self.buf):
            raise GgufTruncated(f"{self.path}: truncated GGUF header")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def _skip_string(self) -> None:
        n = self._scalar("Q")  # read first: it moves pos past the length
        self.pos += n

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype != GGUFValueType.ARRAY:
            return self._scalar(_SCALAR_FORMATS[vtype])
        etype = GGUFValueType(self._scalar("I"))
        n = self._scalar("Q")
        keep = n <= _MAX_KEPT_ARRAY
        if etype == GGUFValueType.STRING:
            if keep:
                return [self._string() for _ in range(n)]
            for _ in range(n):
                self._skip_string()
            return SkippedArray(n)
        if etype == GGUFValueType.ARRAY:
            # Nested arrays exist in the format but in no metadata placement reads: skip them.
            for _ in range(n):
                self._value(GGUFValueType.ARRAY)
            return SkippedArray(n)
        fmt = _SCALAR_FORMATS[etype]
        if keep:
            values = list(struct.unpack_from(f"{self.order}{n}{fmt}", self.buf, self.pos))
            self.pos += n * struct.calcsize(fmt)
            return values
        self.pos += n * struct.calcsize(fmt)
        return SkippedArray(n)


def _type_name(value: int) -> str:
    try:
        return GGMLQuantizationType(value).name
    except ValueError:
        return f"type{value}"
