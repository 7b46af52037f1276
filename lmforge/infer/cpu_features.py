"""What this CPU can do natively, read once: the facts `--dtype auto` and the quantised kernels
are chosen from (quantize.py).

bf16 matmuls are fast only where the CPU multiplies bf16 itself (AMX tiles on Sapphire Rapids
and later, AVX512-BF16 on Cooper Lake / Zen 4); elsewhere (AVX2-only CPUs such as Zen 2/3, and
AVX-512 without BF16) torch converts to fp32 inside the kernel and a bf16 matmul runs several
times slower than fp32. The flags come from /proc/cpuinfo (Linux) and the vector width
torch's own kernels were dispatched to from `torch.backends.cpu.get_cpu_capability()` (which an
`ATEN_CPU_CAPABILITY` override can lower); on other systems or architectures the flags are empty
and nothing is claimed native, so the choice falls back to fp32.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
# The features that decide the kernels (summary order) -> the /proc/cpuinfo flags they need.
FEATURES = {
    "AMX": frozenset({"amx_bf16", "amx_tile"}),
    "AVX512-BF16": frozenset({"avx512_bf16"}),
    "AVX512-VNNI": frozenset({"avx512_vnni"}),
    "AVX512": frozenset({"avx512f"}),
    "AVX2": frozenset({"avx2"}),
}


@dataclass(frozen=True)
class CPUFeatures:
    """The features of one CPU that decide the inference kernels."""

    model: str  # "AMD EPYC 7B13", "Intel(R) Xeon(R) Platinum 8480+", or the platform's name
    machine: str  # platform.machine(): x86_64, aarch64, arm64, ...
    capability: str  # torch's dispatch level: "AVX2", "AVX512", "DEFAULT", ...
    flags: frozenset[str]

    @property
    def x86(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64", "i686", "x86")

    def has(self, feature: str) -> bool:
        """Whether the CPU has one of FEATURES ("AMX", "AVX512-BF16", ...) by its flags."""
        return FEATURES[feature] <= self.flags

    @property
    def amx(self) -> bool:
        return self.has("AMX")

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 matmuls run on bf16 hardware (AMX or AVX512-BF16) rather than through
        fp32 conversion. AVX512-BF16 also needs torch's AVX-512 kernels to be in use."""
        avx512_kernels = self.capability.startswith("AVX512")
        return self.x86 and (self.amx or (self.has("AVX512-BF16") and avx512_kernels))

    def summary(self) -> str:
        """One line: the model and the features that matter, present and absent."""
        if not self.x86:
            return f"{self.model} ({self.machine}, torch kernels: {self.capability})"
        have = [n for n in FEATURES if self.has(n)]
        missing = [n for n in FEATURES if n not in have]
        parts = ", ".join(have) if have else "no AVX2"
        if missing and have:
            parts += "; no " + ", ".join(missing)
        return f"{self.model} ({parts}; torch kernels: {self.capability})"


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) from the text of /proc/cpuinfo (its first processor; x86 lists
    `flags`, ARM `Features`)."""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")  # a line without one has an empty value
        key = key.strip().lower()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def read_cpu_features(cpuinfo: str | None = None, capability: str | None = None) -> CPUFeatures:
    """CPUFeatures from /proc/cpuinfo text (read from the file when None; empty where it does
    not exist) and torch's CPU kernel dispatch level ("AVX2", "AVX512", ...; asked when None,
    "unknown" where torch has none)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    if capability is None:
        try:
            capability = str(torch.backends.cpu.get_cpu_capability())
        except Exception:  # older builds or other architectures: it is informative only
            capability = "unknown"
    model, flags = parse_cpuinfo(cpuinfo)
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return CPUFeatures(model, platform.machine(), capability, flags)


@functools.cache
def cpu_features() -> CPUFeatures:
    """This machine's CPUFeatures, read once per process."""
    return read_cpu_features()
