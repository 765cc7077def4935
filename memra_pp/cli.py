"""The `memra-pp` command line: demo, plan, launch, generate, status, stop, battery, bench, make-tiny."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import threading
import time

from .errors import InputError, MemraError
from .placement.schema import RaySpec

DEFAULT_NAMESPACE = RaySpec.namespace      # the YAML's ray.namespace when it names none


def _print(args, obj, text) -> None:
    """--json: one JSON object on stdout and nothing else; otherwise `text` (a string, or a function that makes
    it: a table is built only when it is printed)."""
    if getattr(args, "json", False):
        print(json.dumps(obj, indent=1, default=str), file=getattr(args, "stdout", None), flush=True)
    else:
        print(text() if callable(text) else text)


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def cmd_plan(args) -> int:
    from .model.weights import open_weights
    from .placement import format_plan, load_placement
    from .placement.planner import plan_of
    p = load_placement(args.config)
    plan = plan_of(args.config, p, open_weights(p.model.path, p.model.format).config)
    _print(args, plan.to_dict(), format_plan(plan))
    return 0


# what make-tiny writes (model/tiny.make_tiny)
TINY_FILES = {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "memra_tiny.json"}


def cmd_make_tiny(args) -> int:
    import os
    from .errors import ConfigError
    from .model.tiny import make_tiny
    if not args.path.strip():
        raise InputError("make-tiny needs a directory to write the checkpoint in, got an empty path")
    if not 0 <= args.seed < 2 ** 63:
        raise InputError(f"--seed must be an integer in [0, 2**63), got {args.seed}")
    path = os.path.expanduser(args.path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{args.path}: exists and is not a directory; give a directory for the checkpoint")
    theirs = sorted(set(os.listdir(path)) - TINY_FILES) if os.path.isdir(path) else []
    if theirs and not os.path.exists(os.path.join(path, "config.json")) and not args.overwrite:
        # a directory of someone's files, never written over unasked (make-tiny's own, cut short, is written again)
        raise ConfigError(f"{args.path}: a directory that holds files but no checkpoint (no config.json: "
                          f"{', '.join(theirs[:3])}{'...' if len(theirs) > 3 else ''}); give an empty or new "
                          f"directory, or pass --overwrite to write the checkpoint's files into it")
    try:
        path = make_tiny(args.path, moe=args.moe, vision=args.vision, seed=args.seed, overwrite=args.overwrite)
    except FileExistsError as e:
        raise ConfigError(f"{e}".replace("pass overwrite=True", "pass --overwrite")) from None
    except OSError as e:
        raise ConfigError(f"{args.path}: cannot write the checkpoint there ({e.strerror or e})") from None
    _print(args, {"path": str(path), "moe": args.moe, "vision": args.vision, "seed": args.seed}, str(path))
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(json_out=args.json, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                    out=getattr(args, "stdout", None))


def _interrupt(signum, frame):
    """SIGTERM (a service manager's stop, `timeout`, `kill`) shuts down as Ctrl-C does. A second SIGTERM is
    ignored from then on (main restores the handler it found only where it was called in-process): `timeout` sends
    two, to the command and then to its process group, and the second cut the shutdown the first started short (the
    stages' segments stayed). SIGKILL still stops it at once. A SIGTERM to the whole process group never reaches
    the local cluster Ray starts: the command runs in a session of its own (_in_own_session)."""
    import signal
    global _TERM_SEEN
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _TERM_SEEN = True
    raise KeyboardInterrupt


_TERM_SEEN = False      # a SIGTERM started this process's shutdown: it stays ignored until the program exits


# the commands that start a deployment, and a local Ray cluster with it where ray.address is local
LAUNCHING = ("demo", "launch", "battery", "bench")
_PARENT = "MEMRA_SESSION_PARENT"     # (not MEMRA_PP_*: those are the runtime's switches, checked strictly)


def _in_own_session(argv: list[str]) -> int:
    """Run this launching command in a child process of its own session, and wait for it; returns its exit status.

    Ray starts a local cluster's GCS and raylet in the caller's process group, blocking only SIGINT there. A
    SIGTERM to that group (`timeout`'s second signal, `kill -TERM -PGID`) ended them under the launcher, whose
    shutdown then waited 60 s for the dead GCS until Ray ended it with exit 1. Here nothing but this process is in
    the caller's group: SIGINT is passed on to the child each time it arrives, SIGTERM (and SIGHUP, as SIGTERM)
    once, which shuts its deployment down as before, and the child gets SIGTERM should this process be killed
    (SIGKILL too), so its deployment never outlives the command."""
    import signal
    import subprocess
    child = subprocess.Popen([sys.executable, "-m", "memra_pp.cli", *argv], start_new_session=True,
                             env=dict(os.environ, **{_PARENT: str(os.getpid())}), preexec_fn=_die_with_parent)

    termed = []

    def forward(signum, frame):
        sig = signal.SIGTERM if signum == signal.SIGHUP else signum
        if sig == signal.SIGTERM:
            if termed:      # the child is shutting down already: Ray's driver shutdown (core_worker.shutdown_driver)
                return      # sets SIGTERM back to the default there, and `timeout`'s second one killed it (exit 143)
            termed.append(sig)
        try:
            child.send_signal(sig)
        except ProcessLookupError:
            pass
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, forward)
    rc = child.wait()
    if termed:      # a SIGTERM ended the child: more of them from here to the exit are ignored, not fatal (Python's
        signal.signal(signal.SIGTERM, signal.SIG_IGN)       # finalization sets its handlers back to the default)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return rc if rc >= 0 else 128 - rc


def _stdout_gone() -> None:
    """stdout's reader has gone: point it at /dev/null, so that Python's flush at exit does not fail again there."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):      # (no real stdout: an in-process call's StringIO)
        pass


def _die_with_parent() -> None:
    """(In the child, before exec) SIGTERM when the parent ends, however it ends (Linux)."""
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))      # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _sigterm_is_ctrl_c() -> None:
    """For a command that launches (demo, launch, battery, bench), called once launch has started Ray (which
    installs its own SIGTERM handler): SIGTERM is Ctrl-C again, the command's shutdown runs and it exits 130."""
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def await_stop_read(dep, limit: float = 2.0, poll: float = 0.02) -> bool:
    """Wait until whoever asked this detached deployment to stop has read the answer (it deletes its request's key
    from Ray's KV once it has read `:done`), at most `limit` seconds (an asker that gave up deletes nothing): this
    process owns the Ray cluster, and the asker's read fails once it is gone. True where the asker read it. (A fixed
    2 s pause did this; the asker polls every 50 ms.)"""
    from ray.experimental import internal_kv
    key, end = dep.kv_key("stop"), time.monotonic() + limit
    while time.monotonic() < end:
        try:
            if key is None or not internal_kv._internal_kv_get(key):
                return True
        except Exception:  # noqa: BLE001 - the cluster is going away: nobody is left to read
            return False
        time.sleep(poll)
    return False


def cmd_launch(args) -> int:
    import memra_pp
    # (SIGTERM is Ctrl-C from when launch has started Ray, main's _sigterm_is_ctrl_c hook: Ray's own handler exits
    # without the shutdown below, and the stages would die with Ray and leave their shared memory behind)
    dep = memra_pp.launch(args.config, detached=True)
    import ray
    addr, name = ray.get_runtime_context().gcs_address, dep.placement.name
    ns = ray.get_runtime_context().namespace
    where = f"--address {addr}" + (f" --namespace {ns}" if ns != DEFAULT_NAMESPACE else "")
    _print(args, {"name": name, "stages": len(dep.actors), "address": addr, "namespace": ns},
           f"deployment {name!r} ready: {len(dep.actors)} stages; ray address {addr}; stop with "
           f"`memra-pp stop {name} {where}`")
    sys.stdout.flush()
    try:      # the supervisor answers a stop (`memra-pp stop`, a connect()ed handle's shutdown): it shuts down
        while not dep.stop_done.wait(0.5):
            pass
        print(f"stop requested: {dep.placement.name!r} " + ("was shut down" if dep.stop_ok else
              "could not be shut down here (the asker kills its stages)"), file=sys.stderr, flush=True)
        await_stop_read(dep)   # a waiting `memra-pp stop` reads the answer before the cluster goes away
    except KeyboardInterrupt:
        pass
    dep.shutdown()
    return 0


def _comma_ids(flag: str, text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise InputError(f"{flag}: {text!r} is not comma-separated token ids (e.g. 5,17,42)") from None


def _check_generate_args(args) -> None:
    """What generate can refuse without the deployment (its vocabulary and max_context are the intake's checks),
    refused before connecting: with no cluster up these were reported as a failed attach, not as the argument."""
    if not args.prompt:
        raise InputError("the prompt is empty: give text, or comma-separated token ids with --ids")
    if args.max_new_tokens < 0:
        raise InputError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise InputError(f"--temperature must be a finite number >= 0 (0 is greedy), got {args.temperature}")
    if args.seed is not None and not -2 ** 63 <= args.seed < 2 ** 63:
        raise InputError(f"--seed must fit in a signed 64-bit integer [-2**63, 2**63), got {args.seed}")


def cmd_generate(args) -> int:
    import memra_pp
    # refused before any Ray work
    _check_generate_args(args)
    prompt = _comma_ids("--ids", args.prompt) if args.ids else args.prompt
    stops = _comma_ids("--stop", args.stop) if args.stop is not None else None     # ("": refused, not ignored)
    dep = memra_pp.connect(args.name, args.namespace, args.address)
    c = dep.client()
    r = c.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                   stop_token_ids=stops, ignore_eos=args.ignore_eos)
    _print(args, r.__dict__, r.text if r.text is not None else " ".join(map(str, r.token_ids)))
    c.close()
    return 0


def cmd_status(args) -> int:
    import memra_pp
    dep = memra_pp.connect(args.name, args.namespace, args.address)
    st = dep.stats()

    def table() -> str:        # "-" where a stage has no figure yet (an idle deployment)
        lines = [f"{'stage':>5} {'device':>8} {'layers':>9} {'busy':>6} {'mbs':>7} {'handoffs':>9} {'p50 us':>8}"]
        for s in st["stages"]:
            ran, crossed = bool(s.get("microbatches")), bool(s.get("handoffs"))     # (0: nothing measured yet)
            lines.append(f"{s['index']:>5} {s['device']:>8} {str(tuple(s['layers'])):>9} "
                         f"{_num(s.get('busy') if ran else None, '.1%'):>6} {_num(s.get('microbatches'), 'd'):>7} "
                         f"{_num(s.get('handoffs'), 'd'):>9} "
                         f"{_num(s.get('handoff_p50_us') if crossed else None, '.1f'):>8}")
        return "\n".join(lines)
    _print(args, st, table)
    return 0


def cmd_stop(args) -> int:
    """Ask the `memra-pp launch` process to shut its deployment down (its supervisor would otherwise restart
    killed stages); if no launcher answers within 20 s, kill the stages directly."""
    import memra_pp
    dep = memra_pp.connect(args.name, args.namespace, args.address)
    dep.shutdown()             # (and disconnects before the launcher takes its cluster down)
    said = {"launcher": f"stopped {args.name}",
            "gone": f"{args.name} was already gone (another launch holds the name now, or none)",
            "killed": f"stopped {args.name} (no launcher answered; stages killed)"}
    _print(args, {"stopped": args.name, "by": dep.stopped_by}, said[dep.stopped_by])
    return 0


def cmd_battery(args) -> int:
    from .battery import main as battery_main
    return battery_main(args)


def cmd_bench(args) -> int:
    from .bench import main as bench_main
    return bench_main(args)


def _command(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand whose own --help says what it does, as the command list does."""
    return sub.add_parser(name, help=help, description=help)


# the commands that start or attach to Ray
RAY_COMMANDS = ("demo", "launch", "generate", "status", "stop", "battery", "bench")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="memra-pp", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = _command(sub, "demo", help="the embedded default: tiny model, two CPU stages, real Ray")
    s.add_argument("--prompts", type=int, default=6, help="concurrent prompts, 1 to 256 (default 6)")
    s.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per prompt (default 24)")
    s.set_defaults(fn=cmd_demo)
    s = _command(sub, "plan", help="print the resolved placement")
    s.add_argument("config", help="placement YAML")
    s.set_defaults(fn=cmd_plan)
    s = _command(sub, "launch", help="launch a detached deployment and keep it up until `memra-pp stop`, Ctrl-C "
                                      "or SIGTERM")
    s.add_argument("config", help="placement YAML")
    s.set_defaults(fn=cmd_launch)
    for name, fn, what in (("generate", cmd_generate, "generate from a launched deployment"),
                           ("status", cmd_status, "a launched deployment's stages: layers, busy, handoffs"),
                           ("stop", cmd_stop, "shut a launched deployment down")):
        s = _command(sub, name, help=what)
        s.add_argument("name", help="deployment name (the YAML's `name`)")
        s.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="the Ray namespace (the YAML's ray.namespace)")
        s.add_argument("--address", default="auto", help="the Ray cluster (`memra-pp launch` prints it)")
        s.set_defaults(fn=fn)
        if name == "generate":
            s.add_argument("prompt", help="text, or comma-separated token ids with --ids")
            s.add_argument("--ids", action="store_true", help="the prompt is token ids, not text")
            s.add_argument("--max-new-tokens", type=int, default=32, help="default 32")
            s.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
            s.add_argument("--seed", type=int, default=None, help="the sampler's seed, for repeatable sampling")
            s.add_argument("--stop", default=None, help="comma-separated token ids that end the request, besides eos")
            s.add_argument("--ignore-eos", action="store_true", help="only --stop and --max-new-tokens end it")
    s = _command(sub, "battery", help="run the residency battery on a live placement")
    s.add_argument("config", help="placement YAML")
    s.add_argument("--out", default=None, help="write the JSON report here")
    s.set_defaults(fn=cmd_battery)
    s = _command(sub, "bench", help="benchmark a placement")
    s.add_argument("config", help="placement YAML")
    s.add_argument("--concurrency", type=int, default=32, help="requests in flight, 1 to 4096 (default 32)")
    s.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (random ids; default 64)")
    s.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    s.add_argument("--prompt-spread", type=float, default=0.0, metavar="S",
                   help="prompt lengths drawn evenly from prompt-len x [1 - S, 1 + S] (0 to 1), as traffic has them")
    s.add_argument("--out", default=None, help="also write the JSON report here")
    s.add_argument("--timeline", default=None, metavar="PNG",
                   help="also plot every stage's microbatches against time (prefill chunks, decode steps) here; "
                        "the extension names the format (.png, .svg, .pdf...)")
    s.set_defaults(fn=cmd_bench)
    s = _command(sub, "make-tiny", help="write a tiny random Qwen3.5 checkpoint")
    s.add_argument("path", help="a new or empty directory")
    s.add_argument("--moe", action="store_true", help="MoE layers instead of dense ones")
    s.add_argument("--vision", action="store_true", help="with a vision tower")
    s.add_argument("--seed", type=int, default=0, help="the weights' random seed (default 0)")
    s.add_argument("--overwrite", action="store_true", help="write over an existing checkpoint or other files")
    s.set_defaults(fn=cmd_make_tiny)
    for p in sub.choices.values():
        p.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    if args.cmd in RAY_COMMANDS:
        # an argument the terminal could not decode (a surrogate escape) made ray.init fail on the command line it
        # records, reported as "cannot attach to a Ray cluster there"
        for a in (sys.argv[1:] if argv is None else argv):
            try:
                a.encode("utf-8")
            except UnicodeEncodeError:
                print(f"memra-pp {args.cmd}: InputError: argument {a!r} is not valid UTF-8 (bytes the terminal "
                      f"could not decode); Ray cannot carry it: pass UTF-8 text", file=sys.stderr)
                return 2
    if args.cmd in LAUNCHING:
        parent = os.environ.pop(_PARENT, None)
        if parent is not None and not parent.isdigit():     # not one _in_own_session set: a stray variable
            parent = None
        if parent is None and argv is None:     # the program itself (not main called in-process): a session
            return _in_own_session(sys.argv[1:])
        if parent is not None and os.getppid() != int(parent):      # it ended before PR_SET_PDEATHSIG was set
            print(f"memra-pp {args.cmd}: the launching process ended before this one started", file=sys.stderr)
            return 130
    hooks = None
    if args.cmd in LAUNCHING:
        import signal
        from .deployment import AFTER_RAY_INIT as hooks
        hooks.append(_sigterm_is_ctrl_c)
        before = signal.getsignal(signal.SIGTERM)
    # --json: the one JSON object goes to this stdout, while everything else printed meanwhile goes to stderr: what
    # Ray copies from the stages' stdout to this process's (log_to_driver), any library's prints
    args.stdout = sys.stdout
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with quiet:
            return args.fn(args)
    except MemraError as e:
        print(f"memra-pp {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:          # a reader that stopped (`| head`): quiet, as other Unix tools (exit as SIGPIPE's)
        _stdout_gone()
        return 141
    except OSError as e:             # the environment's (a file, a disk, HOME): one line, not a traceback
        print(f"memra-pp {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:        # Ctrl-C or SIGTERM: the command's shutdown has run on the way out
        print(f"memra-pp {args.cmd}: interrupted", file=sys.stderr)
        return 130
    finally:                         # (main called in-process: the host's handler and launches as they were)
        if hooks is not None:
            hooks.remove(_sigterm_is_ctrl_c)
            # the program itself, shut down by a SIGTERM, ignores it again while Ray's exit handlers run
            # (ray.shutdown set the default back)
            if threading.current_thread() is threading.main_thread() and before is not None:
                signal.signal(signal.SIGTERM, signal.SIG_IGN if argv is None and _TERM_SEEN else before)


if __name__ == "__main__":
    sys.exit(main())
