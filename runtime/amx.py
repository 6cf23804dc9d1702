"""Permission to use AMX tiles: Linux hands the tile data state to a process only on request.

Kernels built with `isa amx` use the tiles only once `enable(library)` has asked the
kernel (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`) and set the library's
`llmc_amx` flag; where the kernel refuses (an older Linux, a sandbox), the flag stays 0
and the same kernels take their VNNI path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

from llmc.abi import AMX_FLAG

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

_answer: tuple[bool, str] | None = None  # the kernel's, asked once per process


def request() -> tuple[bool, str]:
    """Ask for the tile data permission (once per process): (granted, why not)."""
    global _answer
    if _answer is None:
        if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
            _answer = (False, "not x86-64 Linux")
        else:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            rc = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                              ctypes.c_long(XFEATURE_XTILEDATA))
            _answer = (True, "") if rc == 0 else \
                (False, f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed with errno {ctypes.get_errno()}")
    return _answer


def enable(library: ctypes.CDLL) -> tuple[bool, str]:
    """Let `library`'s kernels use the tiles if the process may: (enabled, why not)."""
    try:
        flag = ctypes.c_int32.in_dll(library, AMX_FLAG)
    except ValueError:
        return False, "the kernels use no AMX tiles"
    granted, why = request()
    flag.value = 1 if granted else 0
    return granted, why
