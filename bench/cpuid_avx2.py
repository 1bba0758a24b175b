"""Make this process's CPU look AVX2-only to every library in it, onnxruntime's MLAS included.

    import cpuid_avx2; cpuid_avx2.enable()   # first thing, before torch / onnxruntime / kiln are imported

`KILN_CPU_ISA=avx2` caps kiln, oneDNN, MKL and ATen through their own switches, but onnxruntime's MLAS has
no switch: it reads cpuid once, when its library loads, and takes AVX-512 wherever cpuid reports it. Linux
can make the `cpuid` instruction fault (arch_prctl(ARCH_SET_CPUID, 0), "CPUID faulting": the `cpuid_fault`
flag in /proc/cpuinfo; KVM offers it to guests). This module does that for the calling thread (threads
created later inherit it) and answers each faulting cpuid from a SIGSEGV handler: the real values with the
AVX-512, AMX and AVX-VNNI bits cleared (leaf 7, subleaves 0 and 1), so every library that looks (MLAS,
onnxruntime's CPUIDInfo, oneDNN's Xbyak, MKL, cpuinfo in torch) sees an AVX2 + FMA CPU. What ran before
enable() (glibc's ifunc choices of memcpy and friends) keeps what it chose.

A benchmarking tool, not part of kiln: a signal handler for SIGSEGV is not something a library should
install behind its user's back. `faults()` counts the cpuids answered (a library that ran cpuid on a hot
path would pay ~10 us each: the count says whether one does).
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import tempfile
from pathlib import Path

_SOURCE = r"""
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static volatile long answered;
static struct sigaction previous;

static void real_cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

/* Leaf 7 subleaf 0: EBX avx512f(16) dq(17) ifma(21) pf(26) er(27) cd(28) bw(30) vl(31); ECX vbmi(1)
   vbmi2(6) vnni(11) bitalg(12) vpopcntdq(14); EDX 4vnniw(2) 4fmaps(3) vp2intersect(8) amx_bf16(22)
   avx512_fp16(23) amx_tile(24) amx_int8(25). Subleaf 1: EAX avx_vnni(4) avx512_bf16(5) avx_ifma(23),
   EDX avx_vnni_int8(4) avx_ne_convert(5). An AVX2 EPYC before Zen 4 has none of them. */
static void mask(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    if (leaf != 7) return;
    if (sub == 0) {
        r[1] &= ~((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | (1u << 28) | (1u << 30) | (1u << 31));
        r[2] &= ~((1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14));
        r[3] &= ~((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | (1u << 24) | (1u << 25));
    } else if (sub == 1) {
        r[0] &= ~((1u << 4) | (1u << 5) | (1u << 23));
        r[3] &= ~((1u << 4) | (1u << 5));
    }
}

static void on_segv(int sig, siginfo_t *info, void *context) {
    ucontext_t *uc = (ucontext_t *)context;
    greg_t *g = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)g[REG_RIP];
    if (ip[0] != 0x0f || ip[1] != 0xa2) {  /* a real fault: give it back to whoever handled it before */
        sigaction(SIGSEGV, &previous, NULL);
        (void)sig; (void)info;
        return;  /* the instruction runs again and faults under the previous handler */
    }
    const uint32_t leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX];
    uint32_t r[4];
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
    real_cpuid(leaf, sub, r);
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
    mask(leaf, sub, r);
    g[REG_RAX] = r[0]; g[REG_RBX] = r[1]; g[REG_RCX] = r[2]; g[REG_RDX] = r[3];
    g[REG_RIP] += 2;
    ++answered;
}

/* 0: cpuid now faults in this thread (and the threads it creates) and is answered masked; else errno. */
int kiln_cpuid_avx2_enable(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, &sa, &previous) != 0) return -1;
    if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) {
        sigaction(SIGSEGV, &previous, NULL);
        return -2;
    }
    return 0;
}

long kiln_cpuid_avx2_answered(void) { return answered; }

/* cpuid leaf 7 subleaf 0's EBX as this thread now sees it (bit 16: avx512f) */
unsigned kiln_cpuid_leaf7_ebx(void) { uint32_t r[4]; real_cpuid(7, 0, r); return r[1]; }
"""

_LIB: ctypes.CDLL | None = None


def _build() -> ctypes.CDLL:
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"kiln-cpuid-avx2-{digest}.so"
    if not path.exists():
        src = path.with_suffix(".c")
        src.write_text(_SOURCE)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(src), "-o", str(path)], check=True)
    return ctypes.CDLL(str(path))


def enable() -> None:
    """Mask AVX-512/AMX/AVX-VNNI out of cpuid for this process from now on (call before any library
    that reads cpuid is imported). Raises where the kernel or CPU offers no CPUID faulting."""
    global _LIB
    if _LIB is not None:
        return
    lib = _build()
    rc = lib.kiln_cpuid_avx2_enable()
    if rc != 0:
        raise RuntimeError("cpuid faulting (arch_prctl ARCH_SET_CPUID) is not available here: onnxruntime's MLAS "
                           "cannot be capped to AVX2 in this process")
    _LIB = lib
    if lib.kiln_cpuid_leaf7_ebx() & (1 << 16):
        raise RuntimeError("cpuid still reports AVX-512F after masking")


def faults() -> int:
    """cpuids answered since enable() (0 before)."""
    return 0 if _LIB is None else int(_LIB.kiln_cpuid_avx2_answered())
