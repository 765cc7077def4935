"""memra_pp/shm.py: a killed process unlinks nothing, so the driver unlinks what killed stages made, by the names
their setup gave or, for a stage killed inside its setup, by the pid every segment name carries."""
import os
import signal
import subprocess
import sys
import textwrap

from memra_pp.shm import segment_name, sweep_dead, unlink_shm_of

MAKE = textwrap.dedent("""
    import os, sys, time
    from multiprocessing import shared_memory, resource_tracker
    from memra_pp.shm import segment_name
    s = shared_memory.SharedMemory(name=segment_name("test", sys.argv[1]), create=True, size=4096)
    resource_tracker.unregister(s._name, "shared_memory")     # as the stages do: the segment outlives a kill
    print(s.name, flush=True)
    time.sleep(60)
""")


def _maker(tag: str):
    p = subprocess.Popen([sys.executable, "-c", MAKE, tag], stdout=subprocess.PIPE, text=True)
    name = p.stdout.readline().strip()
    assert name.startswith(f"mpp-{p.pid}.") and f"-test_{tag}_" in name and os.path.exists(f"/dev/shm/{name}"), name
    lock = f"/dev/shm/{name.split('-test_')[0]}.lock"
    assert os.path.exists(lock), lock               # its maker's lock file, held while it runs
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
        assert unlink_shm_of([dead.pid, live.pid], wait=0.3) == 2           # its segment and its lock file
        assert not os.path.exists(f"/dev/shm/{dead_name}") and os.path.exists(f"/dev/shm/{live_name}")
    finally:
        for p in (dead, live):
            p.kill()
            p.wait(10)
        cleaned = unlink_shm_of([live.pid])     # (asserted below: an assert here would hide the body's failure)
    assert cleaned == 2 and not os.path.exists(f"/dev/shm/{live_name}")


def test_sweep_unlinks_what_dead_makers_left_and_nothing_of_live_ones():
    """sweep_dead (launch and every stage's setup run it) must unlink the segments and lock file of a process
    that was killed, which no driver was left to clean (a SIGKILLed launcher's stages), and keep a live process's
    and this process's own: a maker's flock on its lock file is what tells them apart, not its pid."""
    own = segment_name("test", "own")       # this process's tag and lock (its segment is not made: the name is)
    own_lock = f"/dev/shm/{own.split('-test_')[0]}.lock"
    dead, dead_name = _maker("c")
    live, live_name = _maker("d")
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        dead_lock = f"/dev/shm/{dead_name.split('-test_')[0]}.lock"
        assert os.path.exists(f"/dev/shm/{dead_name}") and os.path.exists(dead_lock)
        assert sweep_dead() >= 1
        assert not os.path.exists(f"/dev/shm/{dead_name}") and not os.path.exists(dead_lock)
        assert os.path.exists(f"/dev/shm/{live_name}") and os.path.exists(own_lock)
    finally:
        for p in (dead, live):
            p.kill()
            p.wait(10)
    assert sweep_dead() >= 1 and not os.path.exists(f"/dev/shm/{live_name}")     # dead now, so swept
    assert os.path.exists(own_lock)


def test_a_forked_childs_exit_leaves_its_parents_lock():
    """A child forked after owner_tag inherits the atexit that drops the lock file: at its exit it removed its
    parent's, whose segments then could never be swept after the parent's death."""
    own = segment_name("test", "fork")
    lock = f"/dev/shm/{own.split('-test_')[0]}.lock"
    assert os.path.exists(lock)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, sys
        from memra_pp.shm import segment_name
        name = segment_name("test", "parent")
        lock = "/dev/shm/" + name.split("-test_")[0] + ".lock"
        pid = os.fork()
        if pid == 0:
            sys.exit(0)                      # a normal exit: atexit runs in the child
        os.waitpid(pid, 0)
        print(os.path.exists(lock))
    """)], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "True", (p.stdout, p.stderr)
