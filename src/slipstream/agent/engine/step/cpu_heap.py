"""The C heap of a CPU engine process: a step's large temporaries reuse freed memory instead of
taking fresh pages from the kernel every step.

    ModelRunner(device cpu) --keep_step_buffers_mapped()--> glibc mallopt: buffers up to
        MMAP_THRESHOLD_BYTES come from the heap, and up to TRIM_THRESHOLD_BYTES of free heap
        stay mapped between steps

A CPU step allocates multi-megabyte tensors and frees them before the next step: each decode
group's keys and values gathered from the paged cache, the MoE block's routed activations,
the logits. glibc's defaults decide per size whether such a buffer is mmapped (and unmapped
on free) and when the heap's free top is handed back to the kernel (trimmed); its thresholds
adapt to the largest buffer freed so far, so whether a step pays for its memory again depends
on the shapes the process has seen. When it does, every page of every buffer is a page fault
on first touch. Measured on the 9.2M-parameter bench MoE (one thread, best of 20 steps):
32 decodes of uneven KV lengths (30 to 161 tokens) took 19 ms per step, 8 ms of it in the
``index_select`` gathers (1.1 ms each for a 2.8 MB gather that takes 0.06 ms in warm memory);
with these settings 9.5 ms. 32 decodes of equal length happened to stay in warm memory (8 ms
either way). So the profiler's calibration load, uneven by design, paid a per-sequence cost
that the bench's equal-length decode steps did not, and the fit charged it to them.

Freed memory stays in the process up to the trim threshold; ``malloc_trim(0)`` (after loading
weights, after a huge request) still hands all of it back. A no-op without glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (half its 64 MiB heap size), which its
# own adaptation reaches after freeing a 32 MiB buffer. Larger buffers (long-prefill attention
# tiles) are still mapped per use: their page faults are small next to their compute.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free heap kept mapped between steps: above a step's temporaries on the models a CPU serves
# (a 512-token prefill chunk of a ~100M model needs a few tens of megabytes).
TRIM_THRESHOLD_BYTES = 128 << 20

_applied = False


def keep_step_buffers_mapped() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once); False without glibc."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        libc = None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    # Setting either threshold turns glibc's adaptation off, so both are set.
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        log.warning("mallopt refused the heap thresholds; CPU steps may page-fault on "
                    "their temporaries")
        return False
    _applied = True
    return True
