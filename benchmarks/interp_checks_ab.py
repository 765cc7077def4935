"""CPU time of the test suite's Triton-interpreter checks (tests/interp.py CHECKS), each run twice side by side (one
a core): as `python SCRIPT ARGS` under TRITON_INTERPRET=1, and as the suite starts it (interp.BOOT, with
tests/interp_fast.py installed). Prints each run's CPU-seconds, both return codes and the totals.

    .venv/bin/python benchmarks/interp_checks_ab.py [CHECK ...]        # all of them by default (about 10 minutes)
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import interp  # noqa: E402


def cpu_of(p):
    """(CPU-seconds, exit code) of the child `p`, reaped."""
    _, status, ru = os.wait4(p.pid, 0)
    return ru.ru_utime + ru.ru_stime, os.waitstatus_to_exitcode(status)


def main(names):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = {}
    for name in names or list(interp.CHECKS):
        script, argvs, _ = interp.CHECKS[name]
        path = os.path.join(interp.HERE, script)
        for a in argvs:
            quiet = dict(env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
            plain = subprocess.Popen([sys.executable, path, *a], **quiet)
            fast = subprocess.Popen([sys.executable, "-c", interp.BOOT, path, *a], **quiet)
            (cb, rb), (cf, rf) = cpu_of(plain), cpu_of(fast)
            res[(name, a)] = (cb, cf)
            print(name, a, "base", round(cb, 1), "fast", round(cf, 1), "ratio", round(cf / cb, 2), rb, rf,
                  flush=True)
    tb, tf = sum(v[0] for v in res.values()), sum(v[1] for v in res.values())
    print("total base", round(tb), "fast", round(tf), "ratio", round(tf / tb, 2))


if __name__ == "__main__":
    main(sys.argv[1:])
