"""memra_pp/shm.py: a killed process unlinks nothing, so the driver unlinks what killed stages made, by the names
their setup gave or, for a stage killed inside its setup, by the pid every segment name carries."""
import os
import signal
import subprocess
import sys
import textwrap

from memra_pp.shm import unlink_shm_of

MAKE = textwrap.dedent("""
    import os, sys, time
    from multiprocessing import shared_memory, resource_tracker
    s = shared_memory.SharedMemory(name=f"mpp_test_{os.getpid()}_{sys.argv[1]}", create=True, size=4096)
    resource_tracker.unregister(s._name, "shared_memory")     # as the stages do: the segment outlives a kill
    print(s.name, flush=True)
    time.sleep(60)
""")


def _maker(tag: str):
    p = subprocess.Popen([sys.executable, "-c", MAKE, tag], stdout=subprocess.PIPE, text=True)
    name = p.stdout.readline().strip()
    assert name == f"mpp_test_{p.pid}_{tag}" and os.path.exists(f"/dev/shm/{name}"), name
    return p, name


def test_segments_of_killed_processes_are_unlinked_by_pid_and_live_ones_kept():
    """unlink_shm_of must unlink every "mpp" segment whose name carries a killed process's pid (once the process
    has exited), and leave a process that still runs alone (it could make another after)."""
    dead, dead_name = _maker("a")
    live, live_name = _maker("b")
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert os.path.exists(f"/dev/shm/{dead_name}")            # a killed process leaves its segment
        assert unlink_shm_of([dead.pid, live.pid], wait=0.3) == 1
        assert not os.path.exists(f"/dev/shm/{dead_name}") and os.path.exists(f"/dev/shm/{live_name}")
    finally:
        for p in (dead, live):
            p.kill()
            p.wait(10)
        cleaned = unlink_shm_of([live.pid])     # (asserted below: an assert here would hide the body's failure)
    assert cleaned == 1 and not os.path.exists(f"/dev/shm/{live_name}")
