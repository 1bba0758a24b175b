"""kiln/openmp.py: the short OpenMP spin is chosen on a busy machine only, never over the user's own
policy, and never after torch has loaded libgomp (too late to matter: not pretended)."""

from __future__ import annotations

import subprocess
import sys

from kiln import openmp


def test_a_busy_machine_gets_the_short_spin():
    env: dict[str, str] = {}
    assert openmp.choose_wait_policy(env, modules={}, load=1.0, cpus=2) == openmp.SHORT_SPIN
    assert env == {"GOMP_SPINCOUNT": openmp.SHORT_SPIN}


def test_an_idle_machine_keeps_libgomps_default():
    env: dict[str, str] = {}
    assert openmp.choose_wait_policy(env, modules={}, load=0.9, cpus=2) is None
    assert openmp.choose_wait_policy(env, modules={}, load=7.9, cpus=16) is None
    assert env == {}


def test_busy_is_what_runs_now_not_the_minute_before():
    """The tasks runnable now decide, this process not counted; the 1-min load average only where they cannot
    be read. After `scripts/demo.sh`'s package install the average was ~1.4 on an idle 2-vCPU machine."""
    env: dict[str, str] = {}
    assert openmp.choose_wait_policy(env, modules={}, runnable=1, load=1.4, cpus=2) is None  # only this one
    assert env == {}
    assert openmp.choose_wait_policy(env, modules={}, runnable=2, load=0.0, cpus=2) == openmp.SHORT_SPIN
    assert env == {"GOMP_SPINCOUNT": openmp.SHORT_SPIN}
    assert openmp.choose_wait_policy({}, modules={}, runnable=4, cpus=8) is None  # 3 others on 8 CPUs
    assert openmp.choose_wait_policy({}, modules={}, runnable=5, cpus=8) == openmp.SHORT_SPIN


def test_runnable_tasks_counts_this_reader():
    found = openmp.runnable_tasks()
    assert found is None or found >= 1


def test_this_processs_own_threads_are_not_other_work(tmp_path):
    """A thread of this process that runs (OpenBLAS's workers spin for a moment after `import numpy`) is not work
    beside it: the count leaves out every running thread of the process but the reading one."""
    tasks = tmp_path / "task"
    for tid, state in (("10", "R"), ("11", "R"), ("12", "S"), ("13", "R")):
        (tasks / tid).mkdir(parents=True)
        (tasks / tid / "stat").write_text(f"{tid} (py thr) {state} 1 2 3")
    assert openmp.own_running_threads(str(tasks)) == 3
    assert openmp.own_running_threads(str(tmp_path / "gone")) == 1
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.90 0.80 1.20 3/107 16779\n")  # this process's three running threads, nothing else
    assert openmp.runnable_tasks(2, str(loadavg), str(tasks)) == 1
    env: dict[str, str] = {}
    assert openmp.choose_wait_policy(env, modules={}, runnable=openmp.runnable_tasks(2, str(loadavg), str(tasks)),
                                     cpus=2) is None
    assert env == {}
    loadavg.write_text("0.90 0.80 1.20 5/107 16779\n")  # and two tasks of other processes: busy on 2 CPUs
    assert openmp.runnable_tasks(2, str(loadavg), str(tasks)) == 3
    assert openmp.choose_wait_policy(env, modules={}, runnable=3, cpus=2) == openmp.SHORT_SPIN


def test_the_users_policy_and_a_loaded_torch_win():
    for given in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(given)
        assert openmp.choose_wait_policy(env, modules={}, load=9.0, cpus=2) is None
        assert env == given
    env = {}
    assert openmp.choose_wait_policy(env, modules={"torch": object()}, load=9.0, cpus=2) is None
    assert env == {}


def test_import_kiln_decides_before_torch_loads():
    code = ("import os, sys; import kiln; from kiln import openmp; "
            "print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'), "
            "openmp.busy((openmp.runnable_tasks() or 1) - 1, os.cpu_count() or 1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if k not in openmp.POLICY})
    torch_loaded, spin, was_busy = out.stdout.split()
    assert torch_loaded == "True"  # kiln imports torch: the decision had to come first
    # the load may change between the import and the check: only a set spin must be the short one
    assert spin in ("None", openmp.SHORT_SPIN), out.stdout
