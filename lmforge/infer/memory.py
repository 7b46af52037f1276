"""Handing freed heap memory back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def return_freed_memory() -> None:
    """Hand the heap pages that are free back to the OS (glibc's malloc_trim; nothing elsewhere).

    glibc raises its mmap threshold (up to 32 MB) each time a block it had mapped is freed, and its
    trim threshold with it, so after a load that converts tensors one at a time, or a generation
    whose KV cache and activations are freed at the end, tens of MB of freed blocks stay resident
    for reuse instead of going back: a process that loads a model and generates once kept them
    for good. Called where such a phase ends (a GGUF load, an `LM` call's engine closing)."""
    if (trim := _libc_trim()) is not None:
        trim(0)
