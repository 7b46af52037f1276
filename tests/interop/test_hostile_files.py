"""Truncated, garbage and hostile GGUF / safetensors files: one CheckpointError line naming the
file, and memory bounded by the file's real size (never the size its header claims).

The files are written byte by byte here following the formats' own descriptions (llama.cpp's
docs/gguf.md, the safetensors README); a valid one of each is checked to load first, so every
rejection below is caused by the one field the case changes.
"""

import json
import struct
import tracemalloc

import numpy as np
import pytest
import torch

from lmforge.errors import CheckpointError
from lmforge.fileio import load_tensors, save_tensors
from lmforge.interop.gguf_header import GGUFHeader
from lmforge.lm import LM
from lmforge.model.config import ModelConfig

F32, Q8_0 = 0, 8  # ggml type ids
U32, STRING, ARRAY = 4, 8, 9  # GGUF value types


def _str(s: bytes | str, length: int | None = None) -> bytes:
    s = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(s) if length is None else length) + s


def gguf_bytes(
    kv: list[bytes] | None = None,
    tensors: list[tuple] | None = None,
    data: bytes | None = None,
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
) -> bytes:
    """A GGUF file: `kv` pre-encoded pairs, `tensors` (name, dims, type, offset), then the data at
    the next multiple of 32 (default: zeros covering the tensors)."""
    kv = [_str("general.architecture") + struct.pack("<I", STRING) + _str("llama")] if kv is None \
        else kv  # fmt: skip
    tensors = [("w", [32, 2], F32, 0)] if tensors is None else tensors
    out = b"GGUF" + struct.pack("<IQQ", version, n_tensors if n_tensors is not None else
                                len(tensors), n_kv if n_kv is not None else len(kv))  # fmt: skip
    out += b"".join(kv)
    for name, dims, kind, offset in tensors:
        out += _str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", kind, offset)
    out += b"\0" * (-len(out) % 32)
    return out + (bytes(1024) if data is None else data)


def _rejects(path, match: str, limit_mb: float = 8.0, read=GGUFHeader) -> str:
    """The one-line CheckpointError the reader (the GGUF header's by default) raises, with
    Python's allocations (numpy's included) during the read bounded by `limit_mb`."""
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=match) as err:
            read(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    assert peak < limit_mb * 2**20, f"{peak / 2**20:.1f} MB allocated"
    return message


def test_valid_handmade_file_parses(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf_bytes())
    header = GGUFHeader(path)
    assert header.meta == {"general.architecture": "llama"}
    t = header.tensors["w"]
    assert (t.shape, t.type_name, t.nbytes) == ((2, 32), "F32", 256)
    assert header.raw("w").shape == (256,)


HUGE = 1 << 60
CASES = {
    "empty": (b"", "empty"),
    "garbage": (b"PK\x03\x04" + bytes(100), "not a GGUF file"),
    "magic only": (b"GGUF", "version needs 4 bytes"),
    "old version": (gguf_bytes(version=1), "version 1 is not supported"),
    "huge tensor count": (gguf_bytes(n_tensors=HUGE), "tensors and .* metadata pairs claimed"),
    "huge kv count": (gguf_bytes(n_kv=HUGE), "metadata pairs claimed"),
    "huge key": (gguf_bytes(kv=[_str(b"k", HUGE)]), "claims .* bytes"),
    "huge string": (
        gguf_bytes(kv=[_str("k") + struct.pack("<I", STRING) + _str(b"v", HUGE)]),
        "k needs",
    ),  # fmt: skip
    "huge array": (
        gguf_bytes(kv=[_str("k") + struct.pack("<IIQ", ARRAY, U32, HUGE)]),
        "claims .* elements",
    ),  # fmt: skip
    "huge string array": (
        gguf_bytes(kv=[_str("k") + struct.pack("<IIQ", ARRAY, STRING, HUGE)]),
        "claims .* elements",
    ),  # fmt: skip
    "unknown value type": (
        gguf_bytes(kv=[_str("k") + struct.pack("<I", 99)]),
        "unknown value type 99",
    ),  # fmt: skip
    "deep arrays": (
        gguf_bytes(kv=[_str("k") + struct.pack("<IIQIQIQ", ARRAY, ARRAY, 1, ARRAY, 1, U32, 0)]),
        "nests arrays",
    ),  # fmt: skip
    "duplicate key": (gguf_bytes(kv=[_str("k") + struct.pack("<II", U32, 1)] * 2), "twice"),
    "bad alignment": (
        gguf_bytes(kv=[_str("general.alignment") + struct.pack("<II", U32, 3)]),
        "power of two",
    ),  # fmt: skip
    "unknown tensor type": (gguf_bytes(tensors=[("w", [32], 999, 0)]), "unknown type 999"),
    "no dimensions": (gguf_bytes(tensors=[("w", [], F32, 0)]), "0 dimensions"),
    "too many dimensions": (gguf_bytes(tensors=[("w", [1] * 9, F32, 0)]), "9 dimensions"),
    "huge dimensions": (gguf_bytes(tensors=[("w", [HUGE, HUGE], F32, 0)]), "more elements"),
    "partial block": (gguf_bytes(tensors=[("w", [33, 1], Q8_0, 0)]), "not whole 32-blocks"),
    "offset past the end": (gguf_bytes(tensors=[("w", [32], F32, 1 << 40)]), "truncated"),
    "misaligned offset": (gguf_bytes(tensors=[("w", [32], F32, 4)]), "not a multiple of 32"),
    "overlap": (gguf_bytes(tensors=[("a", [64], F32, 0), ("b", [32], F32, 128)]), "overlap"),
    "duplicate tensor": (gguf_bytes(tensors=[("a", [8], F32, 0), ("a", [8], F32, 32)]), "twice"),
    "not utf-8": (gguf_bytes(kv=[_str(b"\xff\xfe")]), "not UTF-8"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_gguf_headers(tmp_path, case):
    data, match = CASES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    _rejects(path, match)


def test_truncation_anywhere_is_one_line(tmp_path):
    """Every prefix of a valid file (header, metadata, tensor table, data) is rejected."""
    data = gguf_bytes()
    path = tmp_path / "cut.gguf"
    for cut in range(1, len(data) - 1024 + 255, 7):  # the data holds 256 bytes of tensor
        path.write_bytes(data[:cut])
        _rejects(path, "truncated|needs .* bytes|not a GGUF file|claimed")


def test_lm_load_rejects_hostile_gguf(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(CASES["huge tensor count"][0])
    with pytest.raises(CheckpointError, match="corrupt GGUF header") as err:
        LM.load(path)
    assert "\n" not in str(err.value)


# ---- safetensors -------------------------------------------------------------------------------
def safetensors_bytes(header: dict | bytes, data: bytes = bytes(64), length: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


GOOD = {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}
ST_CASES = {
    "short": (b"\x01\x02", "shorter than the 8-byte header length"),
    "huge header length": (safetensors_bytes(GOOD, length=HUGE), "header length"),
    "not json": (safetensors_bytes(b"{not json"), "not JSON"),
    "not an object": (safetensors_bytes(b"[1, 2]"), "not a JSON object"),
    "unknown dtype": (safetensors_bytes({"w": {**GOOD["w"], "dtype": "F128"}}), "unknown dtype"),
    "bad shape": (safetensors_bytes({"w": {**GOOD["w"], "shape": [4, -4]}}), "not a list"),
    "huge shape": (safetensors_bytes({"w": {**GOOD["w"], "shape": [HUGE, HUGE]}}), "does not fill"),
    "offsets past the end": (
        safetensors_bytes({"w": {**GOOD["w"], "data_offsets": [0, 1 << 40]}}),
        "outside",
    ),  # fmt: skip
    "overlap": (
        safetensors_bytes({**GOOD, "v": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}),
        "overlap",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(ST_CASES))
def test_hostile_safetensors_headers(tmp_path, case):
    data, match = ST_CASES[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    _rejects(path, match, read=load_tensors)


def test_valid_safetensors_still_load(tmp_path):
    path = tmp_path / "model.safetensors"
    save_tensors(path, {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.int64)})
    loaded = load_tensors(path)
    assert torch.equal(loaded["w"], torch.arange(6.0).view(2, 3))
    path.write_bytes(safetensors_bytes(GOOD, np.arange(16, dtype=np.float32).tobytes()))
    assert load_tensors(path)["w"].sum().item() == 120


def test_lm_load_rejects_hostile_safetensors(tmp_path):
    lm = LM.from_config(ModelConfig(vocab_size=32, d_model=16, n_layer=1, n_head=2, max_seq_len=16))
    folder = lm.save(tmp_path / "m")
    weights = folder / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) // 2])  # truncated data: the offsets run past the end
    with pytest.raises(CheckpointError, match="safetensors") as err:
        LM.load(folder)
    assert "\n" not in str(err.value)
