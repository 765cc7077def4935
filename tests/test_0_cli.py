"""The command line: plan prints the table; launch / generate / status / stop drive a detached deployment from
separate processes, and stop ends the launcher (its supervisor must not restart the stopped stages)."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from memra_pp.cli import main

CLI = [sys.executable, "-m", "memra_pp.cli"]


def test_plan_table_and_json(capsys):
    """`memra-pp plan` must print every stage with its layers and roles, and --json the same plan."""
    assert main(["plan", "cluster_configs/4gpu.yaml"]) == 0
    out = capsys.readouterr().out
    assert "cuda:3" in out and "primary" in out and "intake" in out
    assert main(["plan", "cluster_configs/4gpu.yaml", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [s["layer_start"] for s in plan["stages"]][0] == 0 and plan["stages"][-1]["layer_end"] == 64


def test_detached_launch_generate_status_stop(tmp_path):
    """A launched deployment must serve `generate` and `status` from other processes and stop on `stop`.
    The clients find the launcher's cluster with `--address auto` (as an operator would), which is only
    unambiguous while no other Ray cluster runs: this file is named to run before the session's ray_cluster."""
    import ray
    assert not ray.is_initialized(), "another Ray cluster is up in this process: --address auto would be ambiguous"
    from memra_pp.defaults import ensure_tiny
    ensure_tiny()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = open(tmp_path / "launch.log", "w+")
    launcher = subprocess.Popen(CLI + ["launch", "cluster_configs/tiny-cpu.yaml"], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
    try:
        addr, deadline = None, time.monotonic() + 60
        while time.monotonic() < deadline:
            log.seek(0)
            m = re.search(r"ray address (\S+);", log.read())
            if m:
                addr = m.group(1)
                break
            assert launcher.poll() is None, "the launcher exited early"
            time.sleep(0.05)
        assert addr, "the launcher never reported ready"
        run = lambda *a: subprocess.run(CLI + list(a), capture_output=True, text=True,
                                        timeout=120, env=env)
        # independent client processes run side by side (each costs seconds of start-up): the idle status and the
        # torch-free one first, before any request; then both generates and the JSON status; then stop
        with ThreadPoolExecutor(3) as pool:
            idle = pool.submit(run, "status", "tiny-cpu")    # before any request: figures a stage has none of yet
            # a client process has no use for torch: the stage actor's class, which ray.get_actor loads to make a
            # handle, imports its runner only in the stage (a CLI status took 2.9 s with torch, 1.4 s without)
            bare = pool.submit(subprocess.run, [sys.executable, "-c", "import sys; from memra_pp.cli import main; "
                               "rc = main(['status', 'tiny-cpu']); print('torch' in sys.modules, rc)"],
                               capture_output=True, text=True, timeout=120, env=env)
            idle, bare = idle.result(), bare.result()
            assert idle.returncode == 0 and "stage" in idle.stdout, idle.stderr[-2000:]
            # no microbatch and no handoff yet: "-", not a made-up 0.0% busy and 0.0 us
            assert [ln.split()[4] for ln in idle.stdout.splitlines()[1:]] == ["-", "-"], idle.stdout   # busy
            assert [ln.split()[-1] for ln in idle.stdout.splitlines()[1:]] == ["-", "-"], idle.stdout
            assert bare.stdout.splitlines()[-1] == "False 0", (bare.stdout[-2000:], bare.stderr[-2000:])
            g = pool.submit(run, "generate", "tiny-cpu", "5,17,42", "--ids", "--max-new-tokens", "6", "--json")
            # the address the launcher printed, as `--address`'s help says: Ray 2.60 starts the cluster with token
            # authentication and, for an explicit address, sends no token unless memra_pp turns token mode on
            g2 = pool.submit(run, "generate", "tiny-cpu", "5,17,42", "--ids", "--max-new-tokens", "6", "--json",
                             "--address", addr)
            st = pool.submit(run, "status", "tiny-cpu", "--json")
            g, g2, st = g.result(), g2.result(), st.result()
        assert g.returncode == 0, g.stderr
        assert len(json.loads(g.stdout)["token_ids"]) == 6
        assert g2.returncode == 0, g2.stderr[-2000:]
        assert json.loads(g2.stdout)["token_ids"] == json.loads(g.stdout)["token_ids"]
        assert st.returncode == 0 and [s["index"] for s in json.loads(st.stdout)["stages"]] == [0, 1]
        assert "Token authentication" not in st.stderr, st.stderr      # Ray's line on every connect, `auto`'s too
        sp = run("stop", "tiny-cpu")
        assert sp.returncode == 0 and "stopped tiny-cpu" in sp.stdout, sp.stderr
        assert launcher.wait(timeout=30) == 0
    finally:       # on a failure: SIGINT lets the launcher stop its deployment and the Ray it started (a SIGKILL
        if launcher.poll() is None:     # left its cluster running, and the next run's `--address auto` ambiguous)
            launcher.send_signal(signal.SIGINT)
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.kill()


def test_generate_refuses_bad_ids_and_a_dead_address_at_once(capsys):
    """Token ids that are not integers, and an address where nothing listens, are typed errors (exit 2) before
    any Ray work; ray.init alone retried such an address for 13 minutes."""
    import socket
    import ray
    assert main(["generate", "tiny-cpu", "5,x", "--ids"]) == 2
    assert "InputError: --ids: '5,x' is not comma-separated token ids" in capsys.readouterr().err
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                  # a port nothing listens on
    t0 = time.monotonic()
    assert main(["generate", "tiny-cpu", "5", "--ids", "--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"ConfigError: ray.address '127.0.0.1:{port}': nothing accepts a connection there" in err, err
    assert "cannot attach" not in err and err.count("give the address") == 1, err      # (it was wrapped twice)
    assert time.monotonic() - t0 < 10 and not ray.is_initialized()
    for addr in ("garbage", "localhost:abc"):       # Ray's own ValueError was a traceback
        assert main(["status", "tiny-cpu", "--address", addr]) == 2, addr
        err = capsys.readouterr().err
        assert f"ConfigError: ray.address '{addr}': cannot attach to a Ray cluster there (ValueError: " in err, err
        assert not ray.is_initialized()


def test_an_address_that_accepts_but_is_no_ray_cluster_is_refused_at_once(capsys, monkeypatch):
    """An address where something listens but no Ray GCS answers (an HTTP server: the dashboard's port given by
    mistake; a listener that never answers) is a ConfigError within the probe's seconds: ray.init retried there for
    over 120 s, printing Ray's warnings. A stray MEMRA_SESSION_PARENT (not a pid) is ignored, not a traceback."""
    import http.server
    import socket
    import threading
    import ray
    from memra_pp import rayutil

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
    http_srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http_srv.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)                            # accepts (the kernel's backlog), never answers
    # the probe's wait for an answer: 1 s here, not 5 (the silent listener waits it out; 12 s was the bound)
    monkeypatch.setattr(rayutil._require_listening, "__defaults__", (1.0,))
    try:
        for port in (http_srv.server_address[1], silent.getsockname()[1]):
            t0 = time.monotonic()
            assert main(["status", "tiny-cpu", "--address", f"127.0.0.1:{port}"]) == 2
            err = capsys.readouterr().err
            assert f"ConfigError: ray.address '127.0.0.1:{port}': something accepts connections there but does " \
                   f"not answer as a Ray cluster's GCS (gRPC) does" in err, err
            assert time.monotonic() - t0 < 12 and not ray.is_initialized()
    finally:
        http_srv.shutdown()
        http_srv.server_close()
        silent.close()
    monkeypatch.setenv("MEMRA_SESSION_PARENT", "abc")
    assert main(["bench", "cluster_configs/tiny-cpu.yaml", "--concurrency", "0"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_commands_refuse_bad_arguments_before_launching(tmp_path, capsys):
    """demo and bench check their numbers and output paths before launching anything (they used to launch, then
    fail with a traceback); make-tiny's refusals are one typed line naming --overwrite, and its --json is JSON."""
    import ray
    for argv, msg in ((["demo", "--prompts", "0"], "InputError: the demo needs --prompts and --max-new-tokens >= 1"),
                      (["bench", "cluster_configs/tiny-cpu.yaml", "--concurrency", "0"],
                       "InputError: --concurrency must be >= 1, got 0"),
                      (["bench", "cluster_configs/tiny-cpu.yaml", "--concurrency", "100000"],
                       "InputError: --concurrency 100000: the bench streams each request on a thread of its own, at "
                       "most 4096"),
                      (["bench", "cluster_configs/tiny-cpu.yaml", "--prompt-spread", "1.5"],
                       "InputError: --prompt-spread is a fraction from 0 to 1 of --prompt-len, got 1.5"),
                      (["bench", "cluster_configs/tiny-cpu.yaml", "--prompt-spread", "nan"],
                       "InputError: --prompt-spread is a fraction from 0 to 1 of --prompt-len, got nan"),
                      (["bench", "cluster_configs/tiny-cpu.yaml", "--prompt-len", "3000", "--prompt-spread", "0.5"],
                       "InputError: --prompt-len 3000 (prompts up to 4500 tokens with --prompt-spread 0.5) and "
                       "--max-new-tokens 32 need 4531 positions, more than the placement's scheduler.max_context "
                       "(4096): lower them or raise max_context"),
                      (["bench", "cluster_configs/tiny-cpu.yaml", "--timeline", "/nonexistent/dir/t.png"],
                       "InputError: --timeline /nonexistent/dir/t.png: its directory does not exist"),
                      # these launched first, then failed after the run (a traceback) or after the launch
                      (["bench", "cluster_configs/tiny-cpu.yaml", "--out", str(tmp_path)],
                       f"InputError: --out {tmp_path}: is a directory; give a file's path"),
                      (["battery", "cluster_configs/battery-cpu.yaml", "--out", "/nonexistent/dir/b.json"],
                       "InputError: --out /nonexistent/dir/b.json: its directory does not exist"),
                      (["demo", "--max-new-tokens", "99999"],
                       "InputError: --max-new-tokens 99999: the demo's prompts (up to 26 tokens) would need 100024 "
                       "positions, more than its scheduler.max_context (4096); ask for at most 4071"),
                      (["demo", "--prompts", "300"], "InputError: the demo runs at most 256 prompts at once"),
                      (["make-tiny", str(tmp_path / "s"), "--seed", str(2 ** 70)],
                       f"InputError: --seed must be an integer in [0, 2**63), got {2 ** 70}"),
                      (["make-tiny", "README.md"], "ConfigError: README.md: exists and is not a directory"),
                      (["make-tiny", "docs"], "ConfigError: docs: a directory that holds files but no checkpoint "
                                              "(no config.json: ARCHITECTURE.md, BATTERY.md, PERF.md...); give an "
                                              "empty or new directory, or pass --overwrite")):
        assert main(argv) == 2, argv
        assert msg in capsys.readouterr().err, argv
    assert not ray.is_initialized()
    d = tmp_path / "t"
    assert main(["make-tiny", str(d), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"path": str(d), "moe": False, "vision": False, "seed": 0}
    assert main(["make-tiny", str(d), "--moe"]) == 2
    assert "ConfigError: " in capsys.readouterr().err
    assert main(["make-tiny", str(d), "--seed", "3"]) == 2
    assert "holds the seed-0 checkpoint, not seed 3; pass --overwrite" in capsys.readouterr().err


def test_plan_refuses_an_ambiguous_or_mismatched_checkpoint(tmp_path, capsys):
    """A directory of several .gguf files (which quantisation?), a split GGUF's shard, and a format that does not
    match the path are ConfigErrors naming the path (one was loaded silently, the others raised raw exceptions)."""
    fx = "/work/shared/fixtures/qwen35-tiny/dense_text-s404"
    shard = tmp_path / "m-00001-of-00002.gguf"
    shard.write_bytes(b"GGUF")
    cases = ((fx, "auto", "holds 2 .gguf files (dense_text-f32.gguf, dense_text-q8_0.gguf); name one file"),
             (f"{fx}/hf", "gguf", "holds no .gguf file for model.format gguf"),
             (f"{fx}/dense_text-f32.gguf", "safetensors", "is a GGUF file but model.format is safetensors"),
             (str(shard), "auto", "one shard of a split GGUF; merge the shards"),
             ("README.md", "auto", "/README.md' is a file, not a checkpoint: give a Hugging Face checkpoint "
                                   "directory (config.json and *.safetensors) or a .gguf file"))
    for path, fmt, msg in cases:
        f = tmp_path / "p.yaml"
        f.write_text(f"name: p\nmodel: {{path: {path}, format: {fmt}}}\nstages: [{{device: cpu}}]\n")
        assert main(["plan", str(f)]) == 2, path
        assert msg in capsys.readouterr().err, path


def _launched(tmp_path, **popen):
    """`memra-pp launch cluster_configs/tiny-cpu.yaml` in a subprocess, returned (with its log) once it is ready."""
    log = open(tmp_path / "launch.log", "w+")
    launcher = subprocess.Popen(CLI + ["launch", "cluster_configs/tiny-cpu.yaml"], stdout=log,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"), **popen)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        log.seek(0)
        if "ray address" in log.read():
            return launcher, log
        if launcher.poll() is not None:
            break
        time.sleep(0.05)
    launcher.kill()
    log.seek(0)
    raise AssertionError(f"the launcher exited early or never got ready: {log.read()[-2000:]}")


@pytest.mark.parametrize("sigterms", [2, "group"])     # (2: the first SIGTERM, then one every 50 ms)
def test_sigterm_shuts_a_launch_down_like_ctrl_c(tmp_path, sigterms):
    """`memra-pp launch` stopped with SIGTERM (a service manager, `timeout`, `kill`) must shut its deployment down
    as Ctrl-C does: exit 0, its Ray gone, and no shared-memory segment of its stages left (SIGTERM used to kill the
    launcher outright, and the stages' receive slots stayed in /dev/shm). `timeout` sends SIGTERM twice (to the
    command, then to its process group): the second arrived inside the shutdown the first started, the launcher
    exited 130 and the segments stayed; a second SIGTERM is now ignored once the first has started the shutdown.
    "group": SIGTERM to the launcher's whole process group (`kill -TERM -PGID`, what `timeout` sends second) ended
    the GCS and raylet Ray had started in that group, and the shutdown waited 60 s for them, then exited 1; the
    command now runs in a session of its own, so the group holds the launcher alone."""
    import glob
    import ray
    assert not ray.is_initialized()
    before = set(glob.glob("/dev/shm/mpp-*"))
    launcher, log = _launched(tmp_path, start_new_session=sigterms == "group")
    try:
        assert set(glob.glob("/dev/shm/mpp-*")) - before, "the stages made no segment: the check below is vacuous"
        t0 = time.monotonic()
        if sigterms == "group":
            os.killpg(launcher.pid, signal.SIGTERM)
        else:
            launcher.send_signal(signal.SIGTERM)
        if sigterms == 2:       # more, every 50 ms until it exits: inside the shutdown the first one started, and
            while launcher.poll() is None and time.monotonic() - t0 < 60:   # after main returned (Ray's exit
                time.sleep(0.05)                # handlers ran with the handler restored: one killed it, exit 143)
                with contextlib.suppress(ProcessLookupError):
                    launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
        assert time.monotonic() - t0 < 30       # (the group's took 60 s, and exited 1)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    log.seek(0)
    out = log.read()
    assert "Traceback" not in out and "interrupted" not in out, out
    assert set(glob.glob("/dev/shm/mpp-*")) - before == set()


def test_sigterm_shuts_a_bench_down_too(tmp_path):
    """`memra-pp bench` (and demo, battery) stopped with SIGTERM shut their deployment down as Ctrl-C does: exit
    130 with one line, no shared-memory segment left (Ray's own handler exited without the shutdown: the stages'
    segments stayed, with a wall of stack dumps)."""
    import glob
    import ray
    assert not ray.is_initialized()
    before = set(glob.glob("/dev/shm/mpp-*"))
    log = open(tmp_path / "bench.log", "w+")
    bench = subprocess.Popen(CLI + ["bench", "cluster_configs/tiny-cpu.yaml", "--concurrency", "4",
                                    "--max-new-tokens", "3000", "--prompt-len", "8"], stdout=log,
                             stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            log.seek(0)
            if "running 4 concurrent requests" in log.read():     # launched: the bench's requests go in now
                break
            assert bench.poll() is None, "the bench exited early"
            time.sleep(0.05)
        assert set(glob.glob("/dev/shm/mpp-*")) - before, "the stages made no segment: the check below is vacuous"
        log.seek(0)
        assert "running 4 concurrent requests" in log.read(), "the bench never started its requests"
        time.sleep(0.5)                         # requests running (3,000 tokens each: they run for minutes)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 130
    finally:
        if bench.poll() is None:
            bench.kill()
    log.seek(0)
    out = log.read()
    assert "memra-pp bench: interrupted" in out and "Traceback" not in out and "SIGTERM received" not in out, out
    assert set(glob.glob("/dev/shm/mpp-*")) - before == set()



def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


@pytest.mark.parametrize("killed", ["memra-pp", "everything"])
def test_a_sigkilled_launcher(tmp_path, killed):
    """"memra-pp": SIGKILL to the `memra-pp launch` process. Its deployment runs in a child of its own session
    (the launcher's process group holds nothing else), which gets SIGTERM when the launcher dies and shuts the
    deployment down: nothing is left, no segment, no Ray process.
    "everything": that child and its local Ray cluster SIGKILLed too, so nothing was left to unlink the stages'
    segments: they stayed in /dev/shm (with a host path, pinned memory the size of a prefill step) until a
    reboot. Each stage holds an flock on its lock file while it runs; the next launch's sweep takes the dead ones'
    locks and unlinks what they made, and nothing of a live process."""
    import glob
    import ray
    from memra_pp.shm import segment_name, sweep_dead
    assert not ray.is_initialized()
    mine = segment_name("test", "live")      # this process's lock: a live maker's, to be kept
    mine_lock = f"/dev/shm/{mine.split('-test_')[0]}.lock"
    before = set(glob.glob("/dev/shm/mpp-*"))
    launcher, log = _launched(tmp_path)
    child = None
    try:
        child = _children(launcher.pid)
        assert len(child) == 1 and os.getsid(child[0]) == child[0] != os.getsid(launcher.pid), child
        child = child[0]
        made = set(glob.glob("/dev/shm/mpp-*")) - before
        locks = [m for m in made if m.endswith(".lock")]
        assert len(locks) == 2 and len(made) > 2, made      # the two stages' locks and their segments
        if killed == "everything":                         # the child's session: it, and Ray's processes
            os.killpg(child, signal.SIGKILL)
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 60    # (everything: Ray ends the stages once their cluster is gone)
        while time.monotonic() < deadline:
            if not os.path.exists(f"/proc/{child}") and not any(
                    os.path.exists(f"/proc/{m.split('mpp-')[1].split('.')[0]}") for m in locks):
                break
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{child}"), "the deployment outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if child is not None:
            try:
                os.killpg(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if killed == "memra-pp":                # the child's shutdown ran: nothing left to sweep
        log.seek(0)
        assert set(glob.glob("/dev/shm/mpp-*")) - before == set(), log.read()[-2000:]
        return
    assert set(glob.glob("/dev/shm/mpp-*")) - before == made, "the dead stages' segments should still be there"
    assert sweep_dead() == len(made) - len(locks)           # what every stage's setup runs first
    assert set(glob.glob("/dev/shm/mpp-*")) - before == set() and os.path.exists(mine_lock)
