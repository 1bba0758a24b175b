"""How libgomp's threads wait, decided per engine call: spin between a call's layers, asleep soon after it returns.

libgomp (torch's, which oneDNN and kiln's C code share) reads its spin (GOMP_SPINCOUNT, OMP_WAIT_POLICY) once,
when it loads, and kiln/openmp.py could only choose it then, as kiln is imported: a short spin where the machine
was busy at that moment. That froze the wrong choice both ways. MobileNetV2 at 2 threads capped to AVX2 ran
1.54-1.58x onnxruntime under the short spin once it had the cores (each of its 52 oneDNN calls wakes a sleeping
thread) and 0.67-1.00x spinning (bench/results/zoo-cpu-avx2-2026-12-06.md); on a busy machine spinning threads
take the slices the working ones need (ResNet-50 1.97x against 0.95x, kiln/openmp.py); and libgomp's default spin
(300000 polls) burns ~8 ms of a core after every call here, which a server idle between requests should not.

libgomp keeps the count in one variable (`gomp_spin_count_var`), read at the start of every wait. It is not
exported, so the governor finds it by its value: libgomp's rw data holds the count the process started with
(300000 unless GOMP_SPINCOUNT says otherwise; kiln/openmp.py's short spin is 128, not 100, because libgomp's
throttled count is 100) exactly once in the libgomp that oneDNN resolved (/proc/self/maps), and the find is
checked by what the threads do (`_check`: a count of 0 puts a team thread to sleep after every region, a huge one
keeps it awake, counted by its voluntary context switches) before anything relies on it. Then each call sets it
(`begin`; the outermost of calls that overlap):

- where the team fits the cores free now (threads <= CPUs - other runnable tasks, read from /proc/loadavg every
  REFRESH_S off the call path, the median of the last READINGS, this process's own threads not counted): CALL_SPIN,
  100000 polls (~3 ms on a Zen 3 VM, ~30 ns a poll): a thread waits for the next layer, and for the next call of a
  caller that calls back to back, spinning, and sleeps ~3 ms after the last call returns, on its own. Not shorter:
  at 4000 polls (~0.1 ms) a team thread fell asleep at every call's start (engine.run's Python between two calls
  is ~0.1-0.25 ms: ~1.3 voluntary switches a call for each of the 2 threads at 4000, ~0.3 at 8000) and whenever a
  neighbour's task took its partner's core for longer than that; each sleep hands the vCPU away (or halts it) and
  the wake waits for it back. MobileNetV2 at 2 threads beside onnxruntime (which spins) then ran 1.39x its latency
  with blocks spread 1.14-1.80x, against 0.91x (0.81-1.25) at 100000 and 0.92x at libgomp's 300000 (a Zen 3 VM
  with the cores to itself, bench/cnn_scatter.py, bench/results/cnn-scatter-2026-12-07.md): the run-to-run scatter
  of issue 11;
- where it does not fit: the short spin (oversubscribed: a thread that sleeps at once gives its core back and,
  woken, preempts the other work); unless the calling thread runs at a realtime priority (SCHED_FIFO / RR: the
  other work waits for it). At SCHED_FIFO with the 1-min load at 8 (bench/omp_spin_ab.py --realtime),
  MobileNetV2 at 2 threads ran 1.00x onnxruntime under CALL_SPIN, 0.98x under libgomp's 300000 and 1.39x under the
  short spin; at normal priority at load 15-17, 0.50x short, 0.65x CALL_SPIN, 1.19x 300000.

kiln's own pool (pool.c, where kiln's C loops run on a busy machine) follows the same decision: its workers poll
through the gaps between back-to-back calls (up to gemm_native.POOL_FOLLOW_NS) where the team fits, else 30 us after
every loop (pool.c's kiln_pool_follow_ns says what it gains and costs).

The readings are taken by a daemon thread (`_refresh`), not by the call: a reading is an open and a read of
/proc/loadavg (and a listing of /proc/self/task), ~50-100 us, which on the call path made one call in every
REFRESH_S that much slower (a p99 spike). A call only consults the readings it finds and decides again when a new
one has come, by the same rule. The thread is started, and the first reading taken, as the count is located (an
engine's load, or the first call with a team); it reads while calls come and parks on an event IDLE_STOP_S after
the last one began (a server idle between requests keeps no thread waking), which the next call sets; it is a
daemon (it never keeps the process alive) and never raises (a failed reading is no reading, as runnable_tasks'
None). A call after an idle stretch decides from the readings before it until new ones come: the
median of three is what it decided from before as well (one new reading beside two old ones).

Why a bounded count and not libgomp's long one with the team parked at the call's end (an empty region under a
count of 0): the parking region waits for every team thread, and a thread preempted on a loaded machine made it
take 0.4 ms at the median and 8 ms at the 90th percentile (load 17). The count stays kiln's between calls: torch
code the process runs there waits the same way.

Not governed, and said so (`describe()`, `kiln inspect`, the engine's log): a policy the user set
(OMP_WAIT_POLICY / GOMP_SPINCOUNT: theirs wins), KILN_OMP_GOVERN=0, no native loop library (no C compiler), a
libgomp where the count is not found once or the check fails (another OpenMP runtime, a libgomp that changed).
Then libgomp waits as it was told when it loaded, as before this module. And where the process's OpenMP teams
hold more threads than there are CPUs (several threads with teams of their own: contexts on threads, a background
bind), libgomp waits on its throttled count instead (`gomp_throttled_spin_count_var`, 100), whatever this one says;
the same makes the check fail on the real count (so the find runs as an engine loads, on the loading thread).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref

from kiln import openmp
from kiln.kernels.cpu import gemm_native

log = logging.getLogger("kiln.runtime")

LIBGOMP_DEFAULT = 300000  # gomp_spin_count_var when neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY is set
CALL_SPIN = 100000  # the count where the team fits the free cores: ~3 ms of polls on a Zen 3 (~30 ns a poll)
IDLE_SPIN = 0  # the count _check parks a team under
REFRESH_S = 0.2  # how often the refresher reads the free cores again (~50-100 us a reading, off the call path)
IDLE_STOP_S = 5.0  # the refresher parks this long after the last call began (the next call wakes it)
READINGS = 3  # the decision: the median of the last 3 readings
PARK_WAIT_NS = 200_000  # how long _check's park waits to see the team asleep before it restores the count anyway
_TEAM_MAX = 256  # segment_loop.c's OMP_MAX_TEAM
# _check's "huge" count: ~0.3 s of polls (~27 ns a poll on the Zen 4), far past its 5 ms gaps, and bounded: a team of
# another thread that starts a wait meanwhile (each thread that runs OpenMP has a team of its own) is not parked here
CHECK_SPIN = 10_000_000
CHECK_GAP_S = 0.03  # _check's gap between regions under the huge count: past libgomp's default spin (~8 ms here)
SLEEP_WAIT_S = 0.5  # how long _check waits for a team thread to be asleep under a count of 0


def _expected_count(environ) -> int | str:
    """The count libgomp started with, or why it is not kiln's to govern."""
    if os.environ.get("KILN_OMP_GOVERN") == "0":
        return "KILN_OMP_GOVERN=0"
    if "OMP_WAIT_POLICY" in environ:
        return f"the user's OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']}"
    given = environ.get("GOMP_SPINCOUNT")
    if given is None:
        return LIBGOMP_DEFAULT
    if given != openmp.SHORT_SPIN:  # kiln's own: set on import here, or inherited from a kiln parent process
        return f"the user's GOMP_SPINCOUNT={given}"
    return int(given)


def _writable_ranges(address: int, maps: str = "/proc/self/maps") -> tuple[str, list[tuple[int, int]]]:
    """The file holding `address` and its writable mappings, with the anonymous one that starts where they end (.bss).

    Only one that starts there: the next line of /proc/self/maps may be any anonymous mapping placed after a gap
    (oneDNN's JIT code, a heap), whose words hold the count's value by chance. With torch's libgomp and kiln's
    short spin (128), 3 of 6 processes that imported numpy before kiln found it 26 times there, and each
    ran ungoverned at 128 (bench/results/cnn-scatter-2026-12-07.md)."""
    with open(maps) as f:
        lines = [line.split() for line in f.read().splitlines()]
    path = None
    for fields in lines:
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi and len(fields) >= 6:
            path = fields[5]
            break
    if path is None:
        return "", []
    ranges, end = [], None  # end: where the file's last mapping ends (None: the line before was not the file's)
    for fields in lines:
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        mine = len(fields) >= 6 and fields[5] == path
        bss = len(fields) == 5 and lo == end
        if (mine or bss) and fields[1].startswith("rw"):
            ranges.append((lo, hi))
        end = hi if mine else None
    return path, ranges


def find_count(ranges: list[tuple[int, int]], value: int) -> list[int]:
    """Addresses of the aligned 8-byte words in `ranges` that hold `value`."""
    found = []
    for lo, hi in ranges:
        words = memoryview(ctypes.string_at(lo, hi - lo)).cast("Q")
        found += [lo + 8 * i for i, w in enumerate(words) if w == value]
    return found


def voluntary_switches(tid: int) -> int | None:
    """How often thread `tid` of this process went to sleep by itself (/proc: voluntary_ctxt_switches)."""
    try:
        with open(f"/proc/self/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _realtime() -> bool:
    """Whether the calling thread runs at SCHED_FIFO / SCHED_RR: other work runnable then waits for it (and the
    team it starts inherits the policy), so a loaded machine is not oversubscribed for it."""
    try:
        return os.sched_getscheduler(0) in (os.SCHED_FIFO, os.SCHED_RR)
    except (AttributeError, OSError):
        return False


_GOVERNORS: weakref.WeakSet = weakref.WeakSet()  # every Governor of the process (a test makes its own)


class Governor:
    """libgomp's spin count for the process: located on the first call with a team of two or more threads,
    then set per call (begin / end). Thread-safe; one per process (`governor()`)."""

    def __init__(self, lib=None, runnable=openmp.runnable_tasks):
        """`lib`: the native loop library (native_loop.load() on first use); `runnable`: the reading of the
        tasks runnable now (kiln/openmp.runnable_tasks; a test's stand-in)."""
        self._lib = lib
        self._runnable = runnable
        self._lock = threading.Lock()
        _GOVERNORS.add(self)  # its refresher forgotten in a forked child (_after_fork)
        self._active = 0
        self._count: ctypes.c_ulonglong | None = None
        self._original = 0
        self._reason: str | None = None  # why not governed (None: governed, or not decided yet)
        self._with_openmp = False  # the native loop library was built with OpenMP (_load)
        self._spin = CALL_SPIN  # the count of the calls begun now
        # the last READINGS of the tasks runnable, one per REFRESH_S, taken by the refresher thread (never by a call);
        # _taken counts them, _decided_on is _taken at the last decision (-1: none yet)
        self._readings: list[int | None] = []
        self._taken = 0
        self._decided_on = -1
        self._refresher: threading.Thread | None = None
        self._parked = False  # the refresher waits on _wake (no call for IDLE_STOP_S)
        self._wake = threading.Event()
        self._last_begin = 0.0
        self._tids = (ctypes.c_int * _TEAM_MAX)()  # the team's thread ids at the last park
        self._team_size = ctypes.c_int(0)
        self._spinning = True
        self.last = ""  # the last decision, in words

    # ---- locating ----------------------------------------------------------------------------------------
    def _team(self) -> list[int]:
        tids = (ctypes.c_int * _TEAM_MAX)()
        n = self._lib.kiln_omp_team(tids, _TEAM_MAX)
        return list(tids[:n])

    def _load(self) -> bool:
        """The native loop library loaded (once); False with _reason set where it cannot be."""
        if self._lib is None:
            from kiln.kernels.cpu import native_loop

            self._lib = native_loop.load()
            if self._lib is None:
                self._reason = f"no native loop library ({native_loop.reason()})"
                return False
        if not self._with_openmp:
            self._with_openmp = bool(self._lib.kiln_omp_available())  # asked once: begin() asks at every call
            if not self._with_openmp:  # until the count is located
                self._reason = "the native loop library was built without OpenMP"
                return False
        return True

    def _locate(self) -> None:
        """Find and check the count (once); on failure set _reason."""
        lib = self._lib
        expected = _expected_count(os.environ)
        if isinstance(expected, str):
            self._reason = expected
            return
        entry = ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p).value
        path, ranges = _writable_ranges(entry)
        if "gomp" not in os.path.basename(path):
            self._reason = f"the OpenMP runtime is not libgomp ({path or 'not found'})"
            return
        found = find_count(ranges, expected)
        if len(found) != 1:
            self._reason = f"libgomp's spin count ({expected}) found {len(found)} times in {path}, not once"
            return
        count = ctypes.c_ulonglong.from_address(found[0])
        why = self._check(count)
        if why is not None:
            self._reason = f"{path}: {why}"
            return
        self._count, self._original = count, expected
        self._add_reading(self._read())  # the first decision's reading: as the count is found, not at a call
        self._last_begin = time.monotonic()
        self._start_refresher()  # and its refresher (starting a thread is ~1 ms here: not at a call either)

    def _check(self, count: ctypes.c_ulonglong) -> str | None:
        """None when writing `count` changes how the team waits as libgomp's spin count would, else why not.

        A huge count (CHECK_SPIN) must keep every team thread awake (no voluntary context switch) across regions
        CHECK_GAP_S apart: longer than libgomp's default count spins here (~8 ms), so a word that is not the count
        fails, whatever the count is. Preemption on a loaded machine is involuntary: it does not fail the real
        one. Then a count of 0 must put them to sleep (state S, a voluntary switch) after each of two regions;
        waited for up to SLEEP_WAIT_S each, since on a loaded machine a thread may wait for a core first."""
        original = count.value
        try:
            count.value = CHECK_SPIN
            tids = self._team()  # the team's next waits start under the huge count
            if len(tids) < 2:
                return "a team of one thread"
            workers = tids[1:]
            awake = [voluntary_switches(t) for t in workers]
            for _ in range(2):
                time.sleep(CHECK_GAP_S)
                self._team()
            held = [voluntary_switches(t) for t in workers]
            count.value = 0
            self._team()
            asleep = self._wait_asleep(workers)
            before = [voluntary_switches(t) for t in workers]
            for _ in range(2):
                self._team()
                asleep = asleep and self._wait_asleep(workers)
            after = [voluntary_switches(t) for t in workers]
        finally:
            self._park(count, original)
        if None in awake + held + before + after:
            return "a team thread's context switches could not be read"
        if held != awake:
            return f"a huge count did not keep the team awake ({awake} -> {held} voluntary switches)"
        if not asleep or any(b - a < 2 for a, b in zip(before, after)):
            return f"a count of 0 did not put the team to sleep ({before} -> {after} voluntary switches)"
        return None

    @staticmethod
    def _wait_asleep(tids: list[int]) -> bool:
        """Whether every thread of `tids` is seen in state S within SLEEP_WAIT_S."""
        deadline = time.monotonic() + SLEEP_WAIT_S
        while True:
            states = []
            for tid in tids:
                try:
                    with open(f"/proc/self/task/{tid}/stat") as f:
                        states.append(f.read().rpartition(")")[2].split()[0])
                except (OSError, IndexError):
                    return False
            if all(state == "S" for state in states):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)

    # ---- per call ----------------------------------------------------------------------------------------
    def _read(self) -> int | None:
        """One reading of the tasks runnable (None where it fails: the refresher must not raise)."""
        try:
            return self._runnable(1)
        except Exception:  # noqa: BLE001  a stand-in's or /proc's failure: no reading, as runnable_tasks' None
            return None

    def _add_reading(self, reading: int | None) -> None:
        """Keep `reading` among the last READINGS (under self._lock)."""
        self._readings = [*self._readings[1 - READINGS:], reading]
        self._taken += 1

    def _refresh(self) -> None:
        """The refresher thread: a reading every REFRESH_S while calls come; IDLE_STOP_S after the last call began it
        parks on an event (no wake-ups while the process is idle) until a call sets it. Never
        raises (a daemon thread's exception would be printed, and nothing here is worth one)."""
        me = threading.current_thread()
        try:
            while True:
                time.sleep(REFRESH_S)
                with self._lock:
                    if self._refresher is not me:  # replaced (a test's, or after a fork): leave it to the new one
                        return
                    parked = time.monotonic() - self._last_begin > IDLE_STOP_S
                    if parked:
                        self._parked = True
                        self._wake.clear()
                if parked:  # until a call wakes it, then REFRESH_S as ever before the next reading (not at once: the
                    self._wake.wait()  # calls right after that one would find the GIL held by the reading)
                    continue
                reading = self._read()  # outside the lock: a call's begin() never waits for a reading
                with self._lock:
                    if self._refresher is not me:
                        return
                    self._add_reading(reading)
        except BaseException:  # noqa: BLE001  interpreter shutdown (modules torn down) or anything else: just stop
            try:
                with self._lock:
                    if self._refresher is me:
                        self._refresher = None
            except BaseException:  # noqa: BLE001
                pass

    def _start_refresher(self) -> None:
        """Start the refresher thread (under self._lock): as the count is located (an engine's load), else at the
        first call that finds none (a count given, not located: the tests'; in a forked child). Starting a thread
        waits for it to run: ~1 ms at the median on this loaded 2-vCPU VM, which is why an idle refresher parks
        rather than ends (a call after each idle stretch would start one). The thread clears self._refresher
        itself if it stops, so that a call tells whether one runs by that field alone (Thread.is_alive() cost
        ~15 us a call after a few ms asleep here: bench/governor_call_path.py)."""
        if not self._readings:  # no reading yet (the count was given, not located here): the first decision's
            self._add_reading(self._read())
        thread = threading.Thread(target=self._refresh, name="kiln-omp-governor", daemon=True)
        self._refresher, self._parked = thread, False
        try:
            thread.start()
        except RuntimeError:  # no thread to be had (interpreter shutting down): decide from the readings there are
            self._refresher = None

    def _after_fork(self) -> None:
        """In a forked child: no refresher runs there (threads do not survive a fork), and a lock or an event another
        thread held at the fork would never be released."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._refresher, self._parked = None, False

    def _decide(self) -> None:
        """The count of the calls begun from now on, from the last readings (no reading taken here)."""
        threads = self._lib.kiln_omp_max_threads()
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        # the median of the last READINGS (one per REFRESH_S) decides: one task waking for a moment does not flip
        # the policy
        known = sorted(r for r in self._readings if r is not None)
        runnable = known[len(known) // 2] if known else None
        others = None if runnable is None else runnable - 1
        free = cpus if others is None else cpus - others
        realtime = _realtime()
        self._spinning = threads <= free or realtime
        self._spin = CALL_SPIN if self._spinning else int(openmp.SHORT_SPIN)
        # kiln's own pool (pool.c) the same way: its workers awake between calls while they fit
        gemm_native.set_pool_follow(gemm_native.POOL_FOLLOW_NS if self._spinning else 0)
        self._decided_on = self._taken
        seen = "" if others is None else f", {others} other task(s) runnable"
        seen += " (this thread at a realtime priority: the cores are its)" if realtime else ""
        self.last = (f"{threads} thread(s) on {cpus} CPU(s){seen}: "
                     + (f"spin {CALL_SPIN} polls" if self._spinning
                        else f"oversubscribed, short spin ({openmp.SHORT_SPIN})"))

    def locate(self) -> bool | None:
        """Find and check the count now (once; ~0.1 s of the team's regions, _check): an engine's load calls it so
        that its first call does not; begin() finds it where nothing did. governed() after it."""
        with self._lock:
            if self._count is None and self._reason is None and self._load() \
                    and self._lib.kiln_omp_max_threads() >= 2:
                self._locate()
                if self._reason is not None:
                    log.info("kiln: OpenMP wait not governed: %s", self._reason)
            return self.governed()

    def begin(self) -> None:
        """A call starts: its count (the outermost call of overlapping ones decides)."""
        with self._lock:
            self._active += 1
            if self._active > 1 or self._reason is not None:
                return
            if self._count is None:
                if self._load() and self._lib.kiln_omp_max_threads() < 2:
                    return  # a team of one thread: nothing to govern (located at the first call with two or more)
                if self._reason is None:
                    self._locate()
                if self._reason is not None:
                    log.info("kiln: OpenMP wait not governed: %s", self._reason)
                    return
            self._last_begin = time.monotonic()  # the refresher runs while calls come (_refresh)
            if self._refresher is None:
                self._start_refresher()
            elif self._parked:  # idle until now: the refresher reads again (this call decides from the last readings)
                self._parked = False
                self._wake.set()
            if self._decided_on != self._taken:  # a new reading since the last decision
                first, spinning = self._decided_on < 0, self._spinning
                self._decide()
                if first or spinning != self._spinning:  # logged when it changes, not every REFRESH_S
                    log.info("kiln: OpenMP wait: %s", self.last)
            self._count.value = self._spin

    def idle(self) -> bool:
        """Whether begin() and end() would only count a call from this thread: not governed, or a team of one thread
        with the count not located (a 1-thread caller's every call). Read without the lock: a call that races the
        count's locating by another thread's call takes begin() from its next call on, and begin()'s count of calls
        is read only once the count is located (the outermost call decides). ExecutionContext.run skips the pair
        then: ~1 µs of a 1-thread call's ~9 on a one-Relu engine (bench/results/call-overhead-zen4-2026-12-07.md)."""
        if self._reason is not None:
            return True
        return self._count is None and self._with_openmp and self._lib.kiln_omp_max_threads() < 2

    def end(self) -> None:
        """A call returned: its threads sleep on their own within the count begin() set."""
        with self._lock:
            self._active -= 1

    def _park(self, count: ctypes.c_ulonglong, after: int) -> int:
        return self._lib.kiln_omp_park(ctypes.byref(count), IDLE_SPIN, after, PARK_WAIT_NS, self._tids,
                                       ctypes.byref(self._team_size))

    def governed(self) -> bool | None:
        """True: located and checked; False: not governed (reason()); None: not tried yet."""
        return True if self._count is not None else (False if self._reason is not None else None)

    def reason(self) -> str | None:
        return self._reason

    def describe(self) -> str:
        """What the governor does, in words (kiln inspect, the engine's log)."""
        if self._count is not None:
            return (f"kiln governs libgomp's spin per call ({CALL_SPIN} polls, ~3 ms, where the team fits the free "
                    f"cores; {openmp.SHORT_SPIN} where oversubscribed); "
                    + (f"last: {self.last}" if self.last else "no call yet"))
        if self._reason is not None:
            return f"libgomp's own (not governed: {self._reason})"
        return "kiln governs libgomp's spin per call, located at the first call with 2 or more threads"


_GOVERNOR: Governor | None = None
_GOVERNOR_LOCK = threading.Lock()


def _forget_refreshers() -> None:
    for g in list(_GOVERNORS):
        g._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_refreshers)


def governor() -> Governor:
    """The process's governor."""
    global _GOVERNOR
    with _GOVERNOR_LOCK:
        if _GOVERNOR is None:
            _GOVERNOR = Governor()
        return _GOVERNOR
