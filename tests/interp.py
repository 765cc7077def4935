"""The Triton-interpreter checks (tests/*_check.py under TRITON_INTERPRET=1), each one core busy for a minute or
more, run in the background of the session.

A test that reads a check carries `@pytest.mark.interpreter(NAME)` (NAME a key of CHECKS) and calls results(NAME).
conftest.py starts the selected tests' runs when collection ends, at most one a core at once, under SCHED_IDLE (the
kernel gives them only cycles no other process wants: the Ray deployments' tests, whose heartbeats and deadlines
are timed, run as if they were not there) and moves those tests to the end of the session, where they find their
runs done or nearly. Where only such tests were selected, the runs start at normal priority, and a check no
selected test was marked for starts when it is asked for. What a test asserts is unchanged: each run's return code
and output. A run's time limit counts from when its test starts waiting; before that, a run may wait long for idle
cycles. When its test starts waiting, a run is given normal priority back where the system lets a process raise
one (root, or RLIMIT_NICE); elsewhere it keeps SCHED_IDLE, which at the end of the session, with no other test
left, costs it nothing. A run left behind by a killed session ends by itself when its check does."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# NAME -> (script, its argument lists, one process each, the time limit of each in seconds)
CHECKS = {
    "fused_moe": ("fused_moe_check.py", [("float32", "cpu", "1"), ("float32", "cpu", "2")], 600),
    "fused_step": ("fused_step_check.py", [("noblock",), ("block",)], 600),
    "moe_block": ("moe_block_check.py", [("float32", "cpu"), ("bfloat16", "cpu")], 600),
    "fused_decode": ("fused_decode_check.py", [("float32", "cpu"), ("bfloat16", "cpu")], 300),
    "moe_parity": ("fused_moe_parity_check.py", [()], 600),
    "greedy": ("greedy_check.py", [("cpu",)], 300),
    "prefill": ("prefill_check.py", [()], 400),
}


def _idle(pid: int) -> None:
    """The lowest CPU priority there is (SCHED_IDLE), else nice 19, for a process of ours just started (set from
    here, not by a preexec_fn, which can deadlock a child forked from a process with threads). Threads it starts
    later inherit it."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, pid, 19)
        except OSError:         # it has already exited
            pass


def _normal(pid: int) -> None:
    """Normal priority back for every thread of the process, where the system lets us (else it stays idle)."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)
    except (AttributeError, OSError):
        pass


# runs `python SCRIPT ARGS...` as itself (sys.argv, sys.path[0] and __main__ as there), with interp_fast installed
BOOT = ("import os, runpy, sys; sys.argv = sys.argv[1:]; sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0])); "
        "import interp_fast; interp_fast.install(); runpy.run_path(sys.argv[0], run_name='__main__')")


class Run:
    """One check process; its output goes to files (a pipe nobody drains would stall it)."""

    def __init__(self, script: str, argv: tuple, background: bool):
        self.out = tempfile.TemporaryFile("w+")
        self.err = tempfile.TemporaryFile("w+")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        self.p = subprocess.Popen([sys.executable, "-c", BOOT, os.path.join(HERE, script), *argv], env=env,
                                  stdout=self.out, stderr=self.err, text=True)
        if background:
            _idle(self.p.pid)
        self.ended = None       # time.monotonic() when it was first seen ended (by its test or the loop)

    def done(self) -> bool:
        if self.ended is None and self.p.poll() is not None:
            self.ended = time.monotonic()
        return self.ended is not None

    def normal(self) -> None:
        """Normal priority back, where the system allows it (its test is waiting for it now)."""
        if not self.done():
            _normal(self.p.pid)

    def result(self, timeout: float) -> tuple[int, str, str]:
        """(returncode, stdout, stderr); TimeoutExpired (the process killed) past `timeout` seconds from now."""
        try:
            self.p.wait(timeout=timeout)
        finally:
            self.kill()
            self.done()
        self.out.seek(0)
        self.err.seek(0)
        return self.p.returncode, self.out.read(), self.err.read()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


class Background:
    """The session's queued runs, started in order, at most `cores` at once (a thread starts the next as one ends);
    summary() says when the last ended and how long tests waited for them."""

    def __init__(self, names: list[str], cores: int, idle: bool = True):
        self.queue = [(n, i) for n in names for i in range(len(CHECKS[n][1]))]
        self.runs: dict = {}                    # (name, i) -> Run, once started
        self.failed: dict = {}                  # (name, i) -> the error that kept it from starting
        self.idle = idle
        self.cores = max(1, cores)
        self.lock = threading.Condition()
        self.t0 = time.monotonic()
        self.waited = 0.0
        self.stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name="interpreter-checks")
        self.thread.start()

    def _loop(self) -> None:
        with self.lock:
            while not self.stop:
                live = [k for k, r in self.runs.items() if not r.done()]
                while self.queue and len(live) < self.cores:
                    key = self.queue.pop(0)
                    script, argvs, _ = CHECKS[key[0]]
                    try:
                        self.runs[key] = Run(script, argvs[key[1]], background=self.idle)
                    except Exception as e:  # noqa: BLE001 - its test raises it
                        self.failed[key] = e
                        continue
                    live.append(key)
                if not live and not self.queue:
                    return
                self.lock.wait(0.2)

    def has(self, name: str) -> bool:
        """Whether the session queued the check `name` (under the lock: the loop moves a run from the queue)."""
        with self.lock:
            return any(k[0] == name for k in self.queue + list(self.runs) + list(self.failed))

    def run(self, key) -> Run:
        """The run for key, started now (at normal priority) if it was still queued."""
        with self.lock:
            if key in self.failed:
                raise RuntimeError(f"the interpreter check {key} could not start") from self.failed[key]
            if key not in self.runs:
                self.queue.remove(key)
                script, argvs, _ = CHECKS[key[0]]
                self.runs[key] = Run(script, argvs[key[1]], background=False)
            return self.runs[key]

    def close(self) -> None:
        """Kills whatever is left running (a session cut short)."""
        with self.lock:
            self.stop = True
            self.queue.clear()
            runs = list(self.runs.values())
            self.lock.notify_all()
        for r in runs:
            r.kill()

    def summary(self) -> str:
        done = [r.ended - self.t0 for r in self.runs.values() if r.done()]
        last = max(done) if done else 0.0
        how = "SCHED_IDLE" if self.idle else "normal priority: only their tests were selected"
        return (f"interpreter checks: {len(self.runs)} runs in the background ({how}, {self.cores} at once), "
                f"the last done {last:.0f} s into the session; tests waited {self.waited:.0f} s for them")


BACKGROUND: Background | None = None        # set by conftest.py when collection ends


def start(names: list[str], idle: bool = True) -> None:
    """Starts the checks `names` in the background (idle: under SCHED_IDLE, beside other tests)."""
    global BACKGROUND
    if names:
        BACKGROUND = Background(names, len(os.sched_getaffinity(0)), idle)


def results(name: str) -> list[tuple[int, str, str]]:
    """The check `name`'s runs, [(returncode, stdout, stderr)] in its argument lists' order; the background's runs
    where the session started them, else all of them now, at once. None is left running."""
    script, argvs, limit = CHECKS[name]
    bg = BACKGROUND if BACKGROUND is not None and BACKGROUND.has(name) else None
    t = time.monotonic()
    if bg is not None:
        runs = [bg.run((name, i)) for i in range(len(argvs))]
        for r in runs:
            r.normal()
    else:
        runs = [Run(script, argv, background=False) for argv in argvs]
    try:
        return [r.result(limit) for r in runs]
    finally:
        for r in runs:
            r.kill()
        if bg is not None:
            bg.waited += time.monotonic() - t


def coarse_moe_tiles() -> None:
    """For the checks that run whole steps in the interpreter: the per-pair MoE kernels at 32 rows of an expert a
    program, where the H200's tiles take 4, so an eighth of the programs (the interpreter runs each one by one;
    tests/fused_moe_check.py checks the released tiles)."""
    from memra_pp.kernels import fused_moe
    fused_moe.SMALL_TILES = (32,) + fused_moe.SMALL_TILES[1:3] + (32,) + fused_moe.SMALL_TILES[4:]
