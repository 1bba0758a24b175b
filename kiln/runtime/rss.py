"""This process's resident memory: what `kiln build -v` and `kiln bench` report as build and run memory.

On Linux the kernel's high-water mark (VmHWM) is reset when a measurement begins (writing 5 to
/proc/self/clear_refs), so a phase's peak is its own even in a process that peaked higher before.
Elsewhere ru_maxrss, which cannot be reset: an earlier, higher peak hides the phase's (the growth is
then a lower bound, and `method` says so). Lean-runtime safe: the standard library only.
"""

from __future__ import annotations

import ctypes
import resource
import sys
from dataclasses import dataclass


@dataclass
class PeakMemory:
    """The peak resident memory of a phase, less what the process held when the phase began."""

    start_rss: int
    method: str  # "VmHWM" or "ru_maxrss"

    @classmethod
    def start(cls) -> PeakMemory:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return cls(status_bytes("VmRSS"), "VmHWM")
        except OSError:
            return cls(max_rss(), "ru_maxrss")

    def delta(self) -> int:
        """Peak RSS growth since start() (bytes, >= 0)."""
        return max(self.peak() - self.start_rss, 0)

    def peak(self) -> int:
        return status_bytes("VmHWM") if self.method == "VmHWM" else max_rss()


def status_bytes(field: str) -> int:
    """A size field of /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise OSError(f"/proc/self/status has no {field}")


def max_rss() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def resident_bytes() -> int:
    """The process's resident memory now (its peak so far where /proc is missing)."""
    try:
        return status_bytes("VmRSS")
    except OSError:
        return max_rss()


def return_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere). Freed
    blocks of a few MiB stay in the heap otherwise, and the resident size a build peaks at counts them."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
