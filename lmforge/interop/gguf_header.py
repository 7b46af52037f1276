"""A GGUF file's header (metadata and tensor table) read and checked before anything is allocated,
and its tensors as read-only views of a memory map of the file.

The layout is llama.cpp's docs/gguf.md (GGUF versions 2 and 3, little-endian): the magic "GGUF", a
uint32 version, uint64 tensor and key-value counts, the key-value pairs, the tensor infos (name,
dimensions, type, offset), then the tensor data at the next multiple of `general.alignment`.

Every count, length, dimension, type and offset is checked against the bytes the file actually
has before it is used: a count of strings needs at least 8 bytes per string left in the file, a
tensor must lie inside the file, be aligned, not overlap another and have a type whose block size
divides its rows. A truncated, garbage or hostile file (one that claims 2^60 tensors or a
terabyte string) therefore costs one CheckpointError line naming the file and the field, and
memory in proportion to the file's real size, never to what the header claims.

    header = GGUFHeader("model.gguf")
    header.meta["general.architecture"], header.tensors["token_embd.weight"].type_name
    raw = header.raw("token_embd.weight")   # uint8 view of the tensor's bytes, no copy
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2  # arrays of arrays are legal; deeper nesting is not used by any writer
MAX_KEY_BYTES = 65535

# GGUF metadata value types -> little-endian format, for struct and numpy alike (uint8 ... bool,
# uint64, int64, float64); 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")


def ggml_types() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, elements per block, bytes per block), from the gguf package."""
    import gguf

    return {int(t): (t.name, *gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: `shape` in torch order (GGUF lists the fastest-moving
    dimension first), `offset` from the start of the file, `nbytes` as stored."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    type_name: str
    offset: int
    nbytes: int


class _Cursor:
    """Reads little-endian values from `buf`, each read checked against the bytes left."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: corrupt GGUF header: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes at byte {self.pos}, the file has {self.size}")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"{what} length")
        if limit is not None and n > limit:
            raise self.fail(f"{what} claims {n} bytes (at most {limit})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise self.fail(f"{what} is not UTF-8 ({err.reason} at byte {err.start})") from None

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == STRING:
            return self.string(what)
        if kind != ARRAY:
            raise self.fail(f"{what} has unknown value type {kind}")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
        inner = self.u32(f"{what} element type")
        count = self.u64(f"{what} element count")
        # an element's least bytes: a number's, a string's length, an array's type and count
        least = struct.calcsize(_SCALARS.get(inner, "<Q" if inner == STRING else "<IQ"))
        if inner not in _SCALARS and inner not in (STRING, ARRAY):
            raise self.fail(f"{what} has unknown element type {inner}")
        if count * least > self.size - self.pos:  # before any allocation of `count` things
            raise self.fail(f"{what} claims {count} elements, more than the file's "
                            f"{self.size - self.pos} remaining bytes hold")  # fmt: skip
        if inner in _SCALARS:  # numbers: one read, Python values
            values = np.frombuffer(self.buf, _SCALARS[inner], count, self.pos)
            self.pos += count * least
            return values.tolist()
        if inner == STRING:  # vocabularies: 100k+ strings, read in one tight loop
            return self.strings(count, what)
        return [self.value(inner, f"{what}[{i}]", depth + 1) for i in range(count)]

    def strings(self, count: int, what: str) -> list[str]:
        buf, pos, size, length = self.buf, self.pos, self.size, _U64.unpack_from
        out = []
        try:
            for _ in range(count):
                n = length(buf, pos)[0]
                end = pos + 8 + n
                if end > size:
                    raise self.fail(f"{what}[{len(out)}] needs {n} bytes at byte {pos + 8}, the "
                                    f"file has {size}")  # fmt: skip
                out.append(str(buf[pos + 8 : end], "utf-8"))
                pos = end
        except struct.error:
            raise self.fail(f"{what}[{len(out)}] length needs 8 bytes at byte {pos}, the file "
                            f"has {size}") from None  # fmt: skip
        except UnicodeDecodeError as err:
            raise self.fail(f"{what}[{len(out)}] is not UTF-8 ({err.reason})") from None
        self.pos = pos
        return out


class GGUFHeader:
    """A checked GGUF header: `meta` {key: Python value}, `tensors` {name: TensorInfo} in file
    order, `version`, `alignment`, `data_start`; `raw(name)` / `array(name, dtype)` view a
    tensor's bytes in a read-only memory map (no copy; `close()` drops the map)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file not found: {self.path}")
        with open(self.path, "rb") as f:
            try:
                self._map: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise CheckpointError(f"{self.path}: not a GGUF file (empty)") from None
        try:
            self._parse(memoryview(self._map))
        except Exception:
            self.close()
            raise

    def _parse(self, buf: memoryview) -> None:
        c = _Cursor(buf, self.path)
        if bytes(buf[:4]) != MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (no GGUF magic bytes)")
        c.pos = 4
        self.version = c.u32("version")
        if self.version not in VERSIONS:
            raise c.fail(f"version {self.version} is not supported (GGUF {VERSIONS})")
        n_tensors, n_kv = c.u64("tensor count"), c.u64("metadata count")
        # each pair takes >= 8 (key length) + 4 (type) + 1 bytes, each tensor info >= 8 + 4 + 8
        # + 4 + 8: counts beyond what the file can hold are rejected before any loop runs
        if n_kv * 13 + n_tensors * 32 > c.size - c.pos:
            raise c.fail(f"{n_tensors} tensors and {n_kv} metadata pairs claimed, more than the "
                         f"file's {c.size} bytes hold")  # fmt: skip
        meta: dict[str, Any] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}", MAX_KEY_BYTES)
            if key in meta:
                raise c.fail(f"metadata key {key!r} appears twice")
            meta[key] = c.value(c.u32(f"{key} type"), key)
        self.meta = meta
        alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise c.fail(f"general.alignment {alignment!r} is not a power of two")
        self.alignment = alignment
        types = ggml_types()
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor name #{i}", MAX_KEY_BYTES)
            n_dims = c.u32(f"tensor {name} dimension count")
            if not 1 <= n_dims <= MAX_DIMS:
                raise c.fail(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})")
            dims = [c.u64(f"tensor {name} dimension") for _ in range(n_dims)]
            type_id = c.u32(f"tensor {name} type")
            offset = c.u64(f"tensor {name} offset")
            if type_id not in types:
                raise c.fail(f"tensor {name} has unknown type {type_id}")
            infos.append((name, dims, type_id, offset))
        self.data_start = -(-c.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        size = c.size
        for name, dims, type_id, offset in infos:
            type_name, block, block_bytes = types[type_id]
            where = f"tensor {name} ({type_name}, dimensions {dims})"
            if name in self.tensors:
                raise c.fail(f"tensor name {name!r} appears twice")
            count = 1
            for d in dims:  # bounded step by step: a product of huge dims stays a Python int
                count *= d
                if count > size * 256:  # no type stores more than 256 elements per byte
                    raise c.fail(f"{where} holds more elements than the file can")
            if count == 0 or dims[0] % block:
                raise c.fail(f"{where}: rows of {dims[0]} are empty or not whole {block}-blocks")
            nbytes = count // block * block_bytes
            if offset % alignment:
                raise c.fail(f"{where} offset {offset} is not a multiple of {alignment}")
            start = self.data_start + offset
            if start + nbytes > size:
                raise CheckpointError(f"{self.path}: truncated GGUF file ({where} ends at byte "
                                      f"{start + nbytes}, the file has {size})")  # fmt: skip
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors[name] = TensorInfo(name, shape, type_id, type_name, start, nbytes)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise c.fail(f"tensors {a} and {b} overlap")

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name`: a read-only uint8 view of the memory map."""
        if self._map is None:
            raise CheckpointError(f"{self.path}: read after the file was closed")
        t = self.tensors[name]
        return np.frombuffer(self._map, np.uint8, t.nbytes, t.offset)

    def release(self, name: str) -> None:
        """Tell the OS this process is done with a tensor's pages (MADV_DONTNEED on the whole
        pages inside it): they leave this process's resident memory, the page cache keeps them.
        A view still read afterwards faults them in again from the file."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        t = self.tensors[name]
        page = mmap.PAGESIZE
        start, end = -(-t.offset // page) * page, (t.offset + t.nbytes) // page * page
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        """Drop the memory map (views still alive keep it open until they go)."""
        if self._map is not None:
            with contextlib.suppress(BufferError):  # numpy views exist: closed when they go
                self._map.close()
            self._map = None
