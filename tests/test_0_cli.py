"""The command line: plan prints the table; launch / generate / status / stop drive a detached deployment from
separate processes, and stop ends the launcher (its supervisor must not restart the stopped stages)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

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
        addr = None
        for _ in range(240):
            log.seek(0)
            m = re.search(r"ray address (\S+);", log.read())
            if m:
                addr = m.group(1)
                break
            assert launcher.poll() is None, "the launcher exited early"
            time.sleep(0.25)
        assert addr, "the launcher never reported ready"
        run = lambda *a: subprocess.run(CLI + list(a), capture_output=True, text=True,
                                        timeout=120, env=env)
        g = run("generate", "tiny-cpu", "5,17,42", "--ids", "--max-new-tokens", "6", "--json")
        assert g.returncode == 0, g.stderr
        assert len(json.loads(g.stdout)["token_ids"]) == 6
        # the address the launcher printed, as `--address`'s help says: Ray 2.60 starts the cluster with token
        # authentication and, for an explicit address, sends no token unless memra_pp turns token mode on
        g2 = run("generate", "tiny-cpu", "5,17,42", "--ids", "--max-new-tokens", "6", "--json", "--address", addr)
        assert g2.returncode == 0, g2.stderr[-2000:]
        assert json.loads(g2.stdout)["token_ids"] == json.loads(g.stdout)["token_ids"]
        st = run("status", "tiny-cpu", "--json")
        assert st.returncode == 0 and [s["index"] for s in json.loads(st.stdout)["stages"]] == [0, 1]
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
    assert time.monotonic() - t0 < 10 and not ray.is_initialized()
