"""Keep the memory of big request bodies in the process between requests.

A prompt of megabytes is copied a few times on its way through an ext_proc server (gRPC's message,
protobuf's bytes, the decoder's strings), and glibc serves every allocation above its mmap threshold
(128 KiB at start, moving up to the largest block freed so far) with fresh pages from the kernel and
gives them back on free. Every 4 KiB of each copy is then a page fault, a zeroed page and a memory
cgroup charge. `perf record -e cpu-clock` on the trivial ext_proc server under 16 MB bodies through
Envoy (`python -m bench body`'s stack) put 69% of its CPU in the kernel, nearly all of it that page
work, against 11% in the JSON parser. With the thresholds below, in interleaved runs of
`python -m bench body`, the gate added a third to a half less time per 1 MB and 4 MB body and a
fifth to a third less per 16 MB body than before (docs/benchmarks.md).

So blocks up to MMAP_THRESHOLD_BYTES come from the heap, and the heap keeps up to TRIM_THRESHOLD_BYTES
of freed memory at its top instead of returning it at once: a gate that served a burst of big
prompts keeps up to that much more resident. glibc only: elsewhere (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MiB = 1024 * 1024
# The default request.max_body_bytes: a body the gate accepts is not mapped afresh. mallopt answers 0
# to a value above the glibc's limit (2.36, Debian 12's and the image's, takes 128 MiB and more).
MMAP_THRESHOLD_BYTES = 32 * MiB
TRIM_THRESHOLD_BYTES = 256 * MiB
# mallopt(3) parameter numbers, from glibc's malloc/malloc.h (M_TRIM_THRESHOLD -1, M_MMAP_THRESHOLD -3).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_big_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.debug("no glibc mallopt (%s): big bodies use the allocator's defaults", name)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt answers 1 when it took the value.
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
