"""The command line's refusals that need no cluster: each one line naming the argument and its value, a non-zero
exit, and nothing launched, attached or written (an audit of the commands as a vLLM / llama.cpp user drives them)."""
import json
import os

import pytest

from memra_pp.cli import main

TINY = "cluster_configs/tiny-cpu.yaml"


@pytest.fixture
def no_ray(monkeypatch):
    """Any launch or attach fails the test: every case here must be refused before Ray is touched."""
    import memra_pp
    import memra_pp.deployment as deployment

    def boom(*a, **k):
        raise AssertionError("launched or attached before refusing")
    monkeypatch.setattr(memra_pp, "launch", boom)
    monkeypatch.setattr(memra_pp, "connect", boom)
    monkeypatch.setattr(deployment.Deployment, "connect", classmethod(boom))


def _refused(capsys, argv, msg, rc=2):
    assert main(argv) == rc, argv
    cap = capsys.readouterr()
    assert cap.out == "", (argv, cap.out)
    assert msg in cap.err and len(cap.err.strip().splitlines()) == 1, (argv, cap.err)


def test_report_paths_that_cannot_be_written_are_refused_before_launching(tmp_path, capsys, no_ray):
    """bench's --out/--timeline and battery's --out must be refused before the launch when they cannot be written:
    a file as their directory, a name ending in '/', an empty path, a directory root may not write in (/proc),
    and a --timeline whose extension names no image format. Before, each passed the check, ran the whole bench,
    then died with a traceback (NotADirectoryError, IsADirectoryError, matplotlib's ValueError) and no report;
    `--out ''` silently wrote nothing."""
    f = tmp_path / "afile"
    f.write_text("x")
    cases = ((["bench", TINY, "--out", f"{f}/r.json"], f"InputError: --out {f}/r.json: its directory does not exist"),
             (["bench", TINY, "--out", f"{tmp_path}/new/"], f"InputError: --out {tmp_path}/new/: is a directory"),
             (["bench", TINY, "--out", ""], "InputError: --out '': an empty path"),
             (["bench", TINY, "--out", "/proc/r.json"], "InputError: --out /proc/r.json: its directory does not "
                                                        "exist or is not writable (No such file or directory)"),
             (["bench", TINY, "--timeline", str(tmp_path / "t.txt")],
              f"InputError: --timeline {tmp_path}/t.txt: '.txt' is not an image format matplotlib writes; end the "
              f"name with one of "),
             (["bench", TINY, "--timeline", str(tmp_path / "t")],
              f"InputError: --timeline {tmp_path}/t: no extension to name the image format"),
             (["battery", "cluster_configs/battery-cpu.yaml", "--out", f"{f}/b.json"],
              f"InputError: --out {f}/b.json: its directory does not exist"))
    for argv, msg in cases:
        _refused(capsys, argv, msg)
    assert sorted(os.listdir(tmp_path)) == ["afile"], "a refused path was left behind"


def test_bench_prints_its_figures_before_a_report_write_fails(monkeypatch, capsys):
    """A report file that fails to write after the run (a full disk: /dev/full) must leave the printed figures
    and end with one line and exit 2, not a traceback after minutes of benchmarking."""
    import memra_pp
    import memra_pp.bench as bench

    class Dep:
        def shutdown(self):
            pass
    monkeypatch.setattr(memra_pp, "launch", lambda config: Dep())
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: {"tokens_per_s": 1.5})
    assert main(["bench", TINY, "--out", "/dev/full", "--json"]) == 2
    cap = capsys.readouterr()
    assert json.loads(cap.out)["tokens_per_s"] == 1.5
    assert "memra-pp bench: InputError: --out /dev/full: the report could not be written (No space left on " \
           "device)" in cap.err and "Traceback" not in cap.err, cap.err


def test_generate_refuses_its_arguments_before_attaching(capsys, no_ray):
    """generate's own arguments must be refused before it attaches to a cluster: with none up, a negative
    --max-new-tokens was reported as "cannot attach to a Ray cluster"; an empty --stop was silently ignored, an
    empty prompt got as far as the deployment."""
    for argv, msg in ((["generate", "x", "5", "--ids", "--max-new-tokens", "-1"],
                       "InputError: --max-new-tokens must be >= 0, got -1"),
                      (["generate", "x", "5", "--ids", "--temperature", "nan"],
                       "InputError: --temperature must be a finite number >= 0 (0 is greedy), got nan"),
                      (["generate", "x", "5", "--ids", "--temperature", "-0.5"],
                       "InputError: --temperature must be a finite number >= 0 (0 is greedy), got -0.5"),
                      (["generate", "x", "5", "--ids", "--seed", str(2 ** 64)],
                       f"InputError: --seed must fit in a signed 64-bit integer [-2**63, 2**63), got {2 ** 64}"),
                      (["generate", "x", ""], "InputError: the prompt is empty"),
                      (["generate", "x", "5", "--ids", "--stop", ""],
                       "InputError: --stop: '' is not comma-separated token ids")):
        _refused(capsys, argv, "memra-pp generate: " + msg)


def test_arguments_that_are_not_utf8_are_refused_before_ray(capsys, no_ray):
    """An argument the terminal could not decode (Python keeps its bytes as surrogate escapes) must be refused
    naming it: ray.init failed on it and the error blamed the address ("cannot attach to a Ray cluster there
    (UnicodeEncodeError ...)")."""
    _refused(capsys, ["generate", "tiny-cpu", "caf\udce9"],
             "memra-pp generate: InputError: argument 'caf\\udce9' is not valid UTF-8")
    _refused(capsys, ["status", "\udcff"], "memra-pp status: InputError: argument '\\udcff' is not valid UTF-8")


def test_an_unwritable_home_is_one_line_not_a_traceback(monkeypatch, capsys, no_ray):
    """The tiny checkpoint the demo and the shipped YAMLs write under ~/.cache: where that cannot be written (a
    HOME that does not exist), demo and plan must end with one line and a non-zero exit, not a traceback."""
    import memra_pp.defaults as defaults

    def cannot(*a, **k):
        raise FileNotFoundError(2, "No such file or directory", "/nohome")
    monkeypatch.setattr(defaults, "ensure_tiny", cannot)
    monkeypatch.setattr(defaults, "ensure_embedded", cannot)
    _refused(capsys, ["demo"], f"memra-pp demo: ConfigError: {defaults.TINY_PATH}: cannot write the demo's tiny "
                               f"checkpoint there (No such file or directory); make ~/.cache writable or set HOME")
    f = "cluster_configs/tiny-cpu.yaml"
    _refused(capsys, ["plan", f], "memra-pp plan: FileNotFoundError: [Errno 2] No such file or directory: "
                                  "'/nohome'", rc=1)


def test_help_says_what_the_commands_do(capsys):
    """The help must name launch's ways to end (it stopped on `memra-pp stop` too, its help said Ctrl-C only), the
    numbers' defaults and bounds, and that --timeline's extension names the format."""
    for argv, says in ((["launch", "--help"], ["`memra-pp stop`", "SIGTERM"]),
                       (["bench", "--help"], ["1 to 4096 (default 32)", "the extension names the format"]),
                       (["demo", "--help"], ["1 to 256 (default 6)"]),
                       (["generate", "--help"], ["0 (the default) is greedy", "the prompt is token ids"])):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        out = " ".join(capsys.readouterr().out.split())     # (argparse wraps the lines)
        assert all(s in out for s in says), (argv, out)


def test_an_embedded_checkpoint_that_cannot_be_written_is_a_config_error(tmp_path, monkeypatch):
    """ensure_embedded (plan, launch, bench and battery with a shipped YAML) let the OSError of an unwritable
    ~/.cache through raw; it is a ConfigError naming the path, and no partial directory is left."""
    import memra_pp.defaults as defaults
    import memra_pp.model.tiny as tiny
    from memra_pp.errors import ConfigError
    p = tmp_path / "tiny"

    def cannot(path, **k):
        path.mkdir()
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(defaults, "EMBEDDED", {p: {}})
    monkeypatch.setattr(tiny, "make_tiny", cannot)
    with pytest.raises(ConfigError, match=rf"^{p}: cannot write the embedded tiny checkpoint there \(Permission "
                                          rf"denied\); make ~/.cache writable or set HOME"):
        defaults.ensure_embedded(p)
    assert list(tmp_path.iterdir()) == []


def test_launch_prints_a_stop_command_that_works_in_its_namespace(ray_cluster, tmp_path, capsys):
    """(Was a defect.) launch printed `memra-pp stop NAME --address A` whatever the namespace; in any but memra's
    default that command found no deployment. It now names the namespace, and the printed command stops it."""
    import re
    import threading
    import time

    import ray
    from memra_pp.defaults import ensure_tiny
    ns = ray.get_runtime_context().namespace
    assert ns != "memra"        # the session cluster's namespace (conftest.ray_cluster): not the default
    cfg = tmp_path / "p.yaml"
    cfg.write_text(f"name: nsstop\nmodel: {{path: {ensure_tiny()}}}\nstages: [{{device: cpu, num_cpus: 0.1}}]\n")
    rc = {}
    t = threading.Thread(target=lambda: rc.setdefault("launch", main(["launch", str(cfg)])), daemon=True)
    t.start()
    deadline, out = time.monotonic() + 120, ""
    while "stop with" not in out:
        assert t.is_alive() and time.monotonic() < deadline, (rc, out)
        time.sleep(0.1)
        out += capsys.readouterr().out
    cmd = re.search(r"stop with `memra-pp (stop nsstop --address \S+ --namespace (\S+))`", out)
    assert cmd and cmd[2] == ns, out
    assert main(cmd[1].split()) == 0 and "stopped nsstop" in capsys.readouterr().out
    t.join(60)
    assert rc == {"launch": 0}


def test_the_launcher_waits_for_the_stop_answer_to_be_read_not_a_fixed_pause(monkeypatch):
    """`memra-pp launch` owns the Ray cluster: after a stop it must not exit (taking the cluster) before the asker has
    read the answer. It waits for the asker's read (the asker deletes its request's key), not a fixed 2 s; at most
    its limit where nobody reads, and not at all where the cluster is already gone."""
    import threading
    import time
    import types

    from ray.experimental import internal_kv

    from memra_pp import cli
    kv = {b"k": b"1", b"k:done": b"1"}
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda k: kv.get(k))
    dep = types.SimpleNamespace(kv_key=lambda kind: b"k" if kind == "stop" else None)
    reader = threading.Timer(0.3, lambda: (kv.pop(b"k"), kv.pop(b"k:done")))     # the asker reads at 0.3 s
    reader.start()
    t0 = time.monotonic()
    assert cli.await_stop_read(dep, limit=30) is True
    assert 0.3 <= time.monotonic() - t0 < 10, "it returned before the read, or waited on after it"
    reader.join()
    kv[b"k"] = b"1"                                 # an asker that gave up: nobody deletes it
    t0 = time.monotonic()
    assert cli.await_stop_read(dep, limit=0.2) is False and time.monotonic() - t0 >= 0.2

    def gone(k):
        raise ConnectionError("the cluster is gone")
    monkeypatch.setattr(internal_kv, "_internal_kv_get", gone)
    assert cli.await_stop_read(dep, limit=30) is False
