"""The Triton-interpreter checks (tests/*_check.py under TRITON_INTERPRET=1), each one core busy for a minute or
more, run in the background of the session.

A test that reads a check carries `@pytest.mark.interpreter(NAME)` (NAME a key of CHECKS) and calls results(NAME).
conftest.py starts the selected tests' runs when collection ends, at most one a core at once, under SCHED_IDLE (the
kernel gives them only cycles no other process wants: the Ray deployments' tests, whose heartbeats and deadlines
are timed, run as if they were not there) and moves those tests to the end of the session, where they find their
runs done or nearly. A test run alone (or a check no test was marked for) starts its runs when it asks, as before.
What it asserts is unchanged: each run's return code and output. A run's time limit counts from when its test
starts waiting: before that, a run may wait long for idle cycles."""
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
}


def _idle() -> None:
    """In the child before exec: the lowest CPU priority there is (SCHED_IDLE), else nice 19."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


class Run:
    """One check process; its output goes to files (a pipe nobody drains would stall it)."""

    def __init__(self, script: str, argv: tuple, background: bool):
        self.out = tempfile.TemporaryFile("w+")
        self.err = tempfile.TemporaryFile("w+")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, script), *argv], env=env, stdout=self.out,
                                  stderr=self.err, text=True, preexec_fn=_idle if background else None)

    def result(self, timeout: float) -> tuple[int, str, str]:
        """(returncode, stdout, stderr); TimeoutExpired (the process killed) past `timeout` seconds from now."""
        try:
            self.p.wait(timeout=timeout)
        finally:
            self.kill()
        self.out.seek(0)
        self.err.seek(0)
        return self.p.returncode, self.out.read(), self.err.read()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


class Background:
    """The session's queued runs, started in order, at most `cores` at once (a thread starts the next as one ends).
    STATS: when each started and ended, and how long tests waited for them."""

    def __init__(self, names: list[str], cores: int):
        self.queue = [(n, i) for n in names for i in range(len(CHECKS[n][1]))]
        self.runs: dict = {}                    # (name, i) -> Run, once started
        self.cores = max(1, cores)
        self.lock = threading.Condition()
        self.t0 = time.monotonic()
        self.waited = 0.0
        self.ended: dict = {}                   # (name, i) -> seconds into the session it ended
        self.stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name="interpreter-checks")
        self.thread.start()

    def _loop(self) -> None:
        with self.lock:
            while not self.stop:
                for key, r in self.runs.items():
                    if key not in self.ended and r.p.poll() is not None:
                        self.ended[key] = time.monotonic() - self.t0
                live = [k for k in self.runs if k not in self.ended]
                while self.queue and len(live) < self.cores:
                    key = self.queue.pop(0)
                    script, argvs, _ = CHECKS[key[0]]
                    self.runs[key] = Run(script, argvs[key[1]], background=True)
                    live.append(key)
                if not live and not self.queue:
                    return
                self.lock.wait(0.2)

    def has(self, name: str) -> bool:
        """Whether the session queued the check `name` (under the lock: the loop moves a run from the queue)."""
        with self.lock:
            return any(k[0] == name for k in self.queue + list(self.runs))

    def run(self, key) -> Run:
        """The run for key, started now (at normal priority) if it was still queued."""
        with self.lock:
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
        done = [self.ended[k] for k in self.runs if k in self.ended]
        last = max(done) if done else 0.0
        return (f"interpreter checks: {len(self.runs)} runs in the background (SCHED_IDLE, {self.cores} at once), "
                f"the last done {last:.0f} s into the session; tests waited {self.waited:.0f} s for them")


BACKGROUND: Background | None = None        # set by conftest.py when collection ends


def start(names: list[str]) -> None:
    global BACKGROUND
    if names:
        BACKGROUND = Background(names, len(os.sched_getaffinity(0)))


def results(name: str) -> list[tuple[int, str, str]]:
    """The check `name`'s runs, [(returncode, stdout, stderr)] in its argument lists' order; the background's runs
    where the session started them, else all of them now, at once. None is left running."""
    script, argvs, limit = CHECKS[name]
    bg = BACKGROUND
    if bg is not None and bg.has(name):
        t = time.monotonic()
        runs = [bg.run((name, i)) for i in range(len(argvs))]
        try:
            return [r.result(limit) for r in runs]
        finally:
            for r in runs:
                r.kill()
            bg.waited += time.monotonic() - t
    runs = [Run(script, argv, background=False) for argv in argvs]
    try:
        return [r.result(limit) for r in runs]
    finally:
        for r in runs:
            r.kill()
