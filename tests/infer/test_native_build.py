"""The native kernels build wherever they can: with a C++ compiler on PATH (ninja is a
dependency), a compile error in one of lmforge/infer/native/*.cpp must fail here, not only skip the
kernel tests (tests/infer/test_cpu_kernels.py skips its module when the kernels are unavailable)."""

from __future__ import annotations

import os
import shutil

import pytest

from lmforge.infer import cpu_kernels


def test_the_kernels_build_where_a_compiler_is_present():
    if os.environ.get("LMFORGE_NATIVE_KERNELS", "1") == "0":
        pytest.skip("switched off by LMFORGE_NATIVE_KERNELS=0")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) on PATH")
    assert cpu_kernels.native_kernels() is not None, cpu_kernels.unavailable_reason()
