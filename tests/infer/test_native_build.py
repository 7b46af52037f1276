"""The native kernels build wherever they can: with a C++ compiler on PATH (ninja is a
dependency), a compile error in one of lmforge/infer/native/*.cpp must fail here, not only skip the
kernel tests (tests/infer/test_cpu_kernels.py skips its module when the kernels are unavailable)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from lmforge.infer import cpu_kernels


def test_the_kernels_build_where_a_compiler_is_present():
    if os.environ.get("LMFORGE_NATIVE_KERNELS", "1") == "0":
        pytest.skip("switched off by LMFORGE_NATIVE_KERNELS=0")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) on PATH")
    assert cpu_kernels.native_kernels() is not None, cpu_kernels.unavailable_reason()


def test_the_kernel_cache_key_is_the_same_in_every_process():
    """A key that changed with PYTHONHASHSEED recompiled every variant in every new process."""
    code = "from lmforge.infer.cpu_kernels import build_key; print(build_key('c++', ['-O3']))"
    keys = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2", "3")
    }  # fmt: skip
    assert len(keys) == 1 and len(next(iter(keys))) == 12, keys
