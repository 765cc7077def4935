"""Launch, attach to and shut down a deployment: one Ray actor per stage in a placement group (driver side).

Boot order: validate the YAML and plan (no Ray yet), start Ray, create the actors, load every stage (fan-out,
one wait), wire the boundary slots and the ring, start the loops. Any failure tears everything down again.
"""
from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
import weakref
from pathlib import Path

import ray

from .errors import ConfigError, InputError, MemraError, StageFailed
from .rayutil import Limit, SignalsHeld, attach, get as _get, kill_actor
from .placement.planner import Plan, plan_of
from .placement.schema import MAX_TIMEOUT_S, Placement, RaySpec, load_placement
from .shm import shm_names, stage_pids, unlink_shm, unlink_shm_of
from .switches import check_environment

log = logging.getLogger("memra_pp")


def kv_key(namespace: str, name: str, pg_id: str, kind: str) -> bytes:
    """A Ray KV key of one detached deployment: its namespace, name and placement group (one launch: a later
    deployment of the name has another group). "stop" asks it to stop (`memra-pp stop`, a connect()ed handle's
    shutdown; the launching process's supervisor shuts it down and sets KEY + b":done"); "recovery" is where that
    supervisor publishes its recoveries (supervisor.RemoteSupervisor reads them); "adapters" is where the intake keeps
    its loaded adapters (what the supervisor reloads if the intake dies)."""
    return f"memra_pp:{namespace}:{name}:{pg_id}:{kind}".encode()


# called once launch has started or attached Ray: the CLI's SIGTERM handler goes here (ray.init installs its own,
# which exits without the deployment's shutdown, leaving the stages' shared memory behind)
AFTER_RAY_INIT: list = []


def pg_name(name: str) -> str:
    """A detached deployment's placement group: named, so that a connect()ed handle can remove it."""
    return f"memra_pp:{name}"


def _launch_where_attached(p: Placement, detached: bool) -> None:
    """A process already attached to Ray launches in that cluster and namespace: a placement whose `ray` section asks
    for another (a namespace other than the default, a host:port of another cluster) or for a listen address other
    than its node's (only a cluster launch starts takes one) is refused, not silently ignored (DESIGN law 2; connect
    refuses so too). The default namespace is not refused: a detached deployment's stages take the process's, said
    in a warning (its names would be looked for in the default)."""
    here, default = ray.get_runtime_context().namespace, RaySpec()
    if p.ray.namespace != default.namespace and p.ray.namespace != here:
        raise ConfigError(f"ray.namespace {p.ray.namespace!r}: this process is attached to Ray in namespace {here!r}, "
                          f"where launch would name its stages; launch from a process not yet attached to Ray, or "
                          f"attached in {p.ray.namespace!r}")
    # (the address this process's node advertises: an earlier launch's cluster, started with this listen, passes)
    if p.ray.listen != default.listen and p.ray.listen != (node := ray.util.get_node_ip_address()):
        raise ConfigError(f"ray.listen {p.ray.listen!r}: only a Ray cluster that launch starts takes it, and this "
                          f"process is attached to Ray already (its node at {node}); drop the key, or launch from a "
                          f"process not yet attached")
    if p.ray.address not in ("local", "auto"):
        from .rayutil import same_cluster
        gcs = ray.get_runtime_context().gcs_address
        if not same_cluster(p.ray.address, gcs):
            raise ConfigError(f"ray.address {p.ray.address!r}: this process is attached to another Ray cluster "
                              f"(its GCS at {gcs}); launch from a process not yet attached, or attached there")
    if detached and p.ray.namespace != here:
        log.warning(f"ray.namespace: this process is attached to Ray in namespace {here!r}, not the default "
                    f"{p.ray.namespace!r}: the stages are named there (connect(name, namespace={here!r}))")


def _named_pg(name: str):
    """The detached deployment `name`'s placement group in this namespace (None: there is none)."""
    from ray.util.placement_group import get_placement_group
    try:
        return get_placement_group(pg_name(name))
    except ValueError:
        return None


def _named_pg_id(name: str) -> str | None:
    pg = _named_pg(name)
    return None if pg is None else pg.id.hex()


MAX_ADAPTER_NAME = 128


def _clip(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


# this process's handles (launched or connected) not shut down: Ray stays up while any is (Deployment.shutdown)
_LIVE: "weakref.WeakSet[Deployment]" = weakref.WeakSet()


class Deployment:
    _pg_id: str | None = None       # a connected handle: the detached group it found (kv_key)
    _gone: str | None = None        # a connected handle whose launch refresh_actors found shut down

    def __init__(self, placement: Placement, plan: Plan, actors: list, infos: list[dict], run_dir: str | None,
                 owns_ray: bool, detached: bool):
        self.placement, self.plan, self.actors, self.infos = placement, plan, actors, infos
        self.slot_names = [shm_names(x) for x in infos]   # each stage's receiving segments (to clean after a kill)
        # each stage's process as its setup named it (rayutil.proc_identity; none for a connect()ed handle)
        self.procs: dict[int, dict] = {i: x["proc"] for i, x in enumerate(infos) if x.get("proc")}
        self.run_dir, self.owns_ray, self.detached = run_dir, owns_ray, detached
        # its clients not closed, held weakly: a client let go without close() is collected, and its id comes to
        # _forgotten (weakref.finalize), whose intake mailboxes the next client() has forgotten
        self._clients: "weakref.WeakSet" = weakref.WeakSet()
        self._forgotten: queue.SimpleQueue = queue.SimpleQueue()
        self.switches: dict[str, bool] | None = None      # launch's resolved MEMRA_PP_* switches (a restart's too)
        # name -> (slot, path) as this handle last saw the intake's registry (stages/runner.reserve_adapter: the
        # table that gives out slots, whichever handle loads): what a restart reloads if the intake itself is lost
        self._adapter_paths: dict[str, tuple[int, str]] = {}
        self._adapter_seq = -1      # the intake registry's version _adapter_paths was read at (saw_adapters)
        self._actors_lock = threading.Lock()
        self._pg, self.transports, self.supervisor = None, ["shm"] * len(actors), None
        self._tokenizer = None
        # this driver's Ray job (hex): its requests carry it, so that the intake aborts them if the driver ends
        # without closing its clients (stages/drivers.py); None where Ray is not up (a handle made in a test)
        self.job = ray.get_runtime_context().get_job_id() if ray.is_initialized() else None
        self._down = False             # shutdown was called: every later use is refused
        self.connected = False         # made by connect(): its shutdown asks the launching process to stop it
        self.stopped_by: str | None = None   # a connected handle's shutdown: "launcher", "killed" or "gone"
        self.stop_done = threading.Event()   # a stop request was answered (the launcher's shutdown ran or failed)
        self.stop_ok = False                 # ... and its shutdown completed
        _LIVE.add(self)
        self._torn_down = False        # its teardown completed: a second shutdown only stops Ray if still asked
        # one shutdown at a time (two threads, or a stop request's and the caller's): a second one during the first
        # tore down beside it, and the first's ray.shutdown() made the second's ray.kill raise Ray's own error
        self._shutdown_lock = threading.Lock()
        self.vocab_size = infos[0]["vocab_size"]
        self.eos = infos[0]["eos"]

    # -- boot -------------------------------------------------------------------------------------------------
    @classmethod
    def launch(cls, config, detached: bool = False) -> "Deployment":
        from .model.weights import open_weights    # (torch-free: a CPU placement's launcher never imports torch)
        placement = load_placement(config)
        switches = check_environment()     # the MEMRA_PP_* switches, resolved once: every stage's setup gets them
        if placement.ray.address == "local" and not ray.is_initialized():
            # launch starts a private cluster here, so the stages run on this host: a device it lacks, refused now
            for i, s in enumerate(placement.stages):
                if s.is_cuda:
                    from .engine import parse_device        # (torch, for its device count: a CUDA placement's)
                    try:
                        parse_device(s.device)
                    except ConfigError as e:
                        raise ConfigError(f"stages[{i}].device: {e}") from None
        mc = open_weights(placement.model.path, placement.model.format).config
        plan = plan_of(config, placement, mc)
        # read now: a malformed tokenizer.json is refused at boot, not at the end of every request (whose tokens
        # were computed and then lost to the ConfigError its text raised)
        from .model.tokenizer import Tokenizer
        tokenizer = Tokenizer.for_model(placement.model.path, placement.model.format)
        for w in plan.warnings:
            log.warning(w)
        owns_ray = cls._ray_up(placement, detached)
        run_dir = tempfile.mkdtemp(prefix="memra-")
        actors, pg = [], None
        try:
            from ray.util.placement_group import placement_group, remove_placement_group
            if detached:      # a detached stage's actor name is the deployment's: Ray would refuse it raw
                try:
                    ray.get_actor(f"{placement.name}.stage0")
                except ValueError:
                    pass
                else:
                    raise ConfigError(f"name: a deployment named {placement.name!r} is already running in namespace "
                                      f"{ray.get_runtime_context().namespace!r}; stop it (memra-pp stop "
                                      f"{placement.name}) or give this one another name")
            _require_fits(plan.stages)
            pg = placement_group([{"CPU": s.num_cpus} for s in plan.stages], strategy="STRICT_PACK",
                                 lifetime="detached" if detached else None,    # detached actors outlive us
                                 name=pg_name(placement.name) if detached else "")
            t = Limit.of(placement.timeouts, "ready_s")
            _get(pg.ready(), t, "placement group")
            for s in plan.stages:
                actors.append(cls._make_actor(placement, s, pg, detached))
            transports, probes = cls._transports(placement, plan, actors, t)
            infos = _get([a.setup.remote(placement.to_dict(), plan.to_dict(), i, run_dir, transports[i], switches)
                          for i, a in enumerate(actors)], t, "stage setup")
            infos[0]["transport_probes"] = probes
            cls._wire(plan, actors, infos, t, placement.scheduler.kv_pages)
            if detached:      # other handles load adapters too: the intake keeps its registry where a restart reads it
                _get(actors[0].registry_key.remote(kv_key(ray.get_runtime_context().namespace, placement.name,
                                                          pg.id.hex(), "adapters")), t, "adapter registry key")
            _get([a.start.remote() for a in actors], t, "stage start")
        except BaseException:
            pids = stage_pids(actors)   # before the kill: a stage killed inside its setup names no segment
            for a in actors:
                ray.kill(a)
            unlink_shm_of(pids)
            if pg is not None:
                remove_placement_group(pg)
            if owns_ray:
                ray.shutdown()
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        dep = cls(placement, plan, actors, infos, run_dir, owns_ray, detached)
        dep._tokenizer, dep._mc = tokenizer or False, mc
        dep._pg, dep.transports, dep.switches = pg, transports, switches
        from .supervisor import Supervisor
        dep.supervisor = Supervisor(dep)
        dep.supervisor.start()
        return dep

    @staticmethod
    def _make_actor(placement: Placement, s, pg, detached: bool):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from .stages.actor import StageActor
        # (the runtime's switches, MEMRA_PP_*, are not taken from here: setup is given the driver's values)
        opts = dict(num_cpus=s.num_cpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=s.index))
        if s.device != "cpu":
            # a CUDA stage sees every GPU of its host, even where the cluster has Ray hide them from zero-GPU
            # workers (RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO): only a worker started with this variable can. A CPU
            # stage needs no environment of its own (its setup sets torch's threads), so Ray can give it any idle
            # worker: a runtime_env costs each actor a worker started for it (measured: 0.8 s to the actor's
            # __init__ against 0.44 s for a fresh plain worker and 0.1 s for a prestarted one)
            env = {"OMP_NUM_THREADS": str(s.threads), "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
            opts["runtime_env"] = {"env_vars": env}
        if detached:
            opts.update(name=f"{placement.name}.stage{s.index}", lifetime="detached")
        return StageActor.options(**opts).remote()

    def new_actor(self, i: int):
        """A fresh actor for stage i in its placement-group bundle (the supervisor's restart)."""
        return self._make_actor(self.placement, self.plan.stages[i], self._pg, self.detached)

    def wire(self, actors, infos, timeout: float) -> None:
        self._wire(self.plan, actors, infos, timeout, self.placement.scheduler.kv_pages)

    @staticmethod
    def _wire(plan: Plan, actors, infos, t: float, kv_limit: int | None = None) -> None:
        """Connect every boundary and the ring (one fan-out); infos are the stages' setup / relink answers. First the
        KV budget the intake admits against, from every stage's memory now that all are loaded (kv_budget)."""
        n = len(actors)
        ti = plan.tower_index
        tower = (actors[ti], infos[ti]["ctx_id"]) if ti != 0 else (None, None)
        # at least one page: every pool already holds one beyond its null and sink blocks (model/cache.py); a
        # request needing more pages than the budget is refused at submission (Scheduler.validate)
        pages, reports = _measure_kv(actors, t, kv_limit)
        kv = (pages, reports[0]["kv_block"])
        _get([a.connect.remote(infos[i + 1]["endpoint"] if i + 1 < n else None,
                               infos[0]["ring"] if i == n - 1 and n > 1 else None, t,
                               *(tower if i == 0 else (None, None)), kv=kv if i == 0 else None)
              for i, a in enumerate(actors)], t, "stage wiring")

    @staticmethod
    def _transports(p: Placement, plan: Plan, actors, timeout: float) -> tuple[list[str], list[dict]]:
        """The transport of each stage's upstream boundary: shm when either side is a CPU, else the YAML's
        `transport`; `auto` is resolved per boundary by a real peer-copy probe (a pair that claims P2P but copies
        wrong falls back to the host path)."""
        out, probes, todo = ["shm"] * len(plan.stages), [], []
        for i in range(1, len(plan.stages)):
            a, b = plan.stages[i - 1].device, plan.stages[i].device
            if a == "cpu" or b == "cpu":
                continue
            if p.transport != "auto":
                out[i] = p.transport
            else:
                todo.append(i)
        if todo:
            res = _get([actors[i].probe_transport.remote(int(plan.stages[i - 1].device.split(":")[1]),
                                                         int(plan.stages[i].device.split(":")[1]))
                        for i in todo], timeout, "transport probe")
            for i, r in zip(todo, res):
                out[i] = "peer" if r["ok"] else "host"
                probes.append({"boundary": i, **r})
                if not r["ok"]:
                    log.warning(f"boundary {i}: peer copy check failed ({r['detail']}); using the host path")
        return out, probes

    @staticmethod
    def _ray_up(p: Placement, detached: bool = False) -> bool:
        if ray.is_initialized():
            _launch_where_attached(p, detached)
            return False
        if p.ray.address == "local" and threading.current_thread() is not threading.main_thread():
            # a local cluster started from another thread serves until that thread ends: Ray's head processes are
            # started with PR_SET_PDEATHSIG (SIGKILL), which Linux sends when the thread that forked them exits; the
            # deployment's shutdown then waited 60 s for Ray's GCS and Ray ended the process (exit 1). Attaching
            # to a running cluster from a thread starts no process and is left alone.
            raise ConfigError(f"memra_pp.launch({p.name!r}) from thread {threading.current_thread().name!r} would "
                              f"start Ray there: launch from the main thread (or call ray.init() in the main thread "
                              f"first; a launch onto Ray already up may run in any thread)")
        with SignalsHeld() as held:     # (a Ctrl-C or SIGTERM inside Ray's start left its agents running)
            if p.ray.address == "local":
                need = sum(s.num_cpus for s in p.stages) + 0.5
                # Ray's "token authentication is enabled" warning on every start of a local cluster: not ours to say
                quiet = logging.getLogger("ray._private.authentication.authentication_token_setup")
                level = quiet.level
                quiet.setLevel(logging.ERROR)
                try:
                    ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(need)), include_dashboard=False,
                             namespace=p.ray.namespace, log_to_driver=True, logging_level=logging.WARNING,
                             _node_ip_address=p.ray.listen)
                finally:
                    quiet.setLevel(level)
            else:
                attach(p.ray.address, p.ray.namespace)
        for f in AFTER_RAY_INIT:
            f()
        try:        # a signal held while Ray started, now that it can stop cleanly: the cluster goes with the launch
            held.deliver()
        except BaseException:
            ray.shutdown()
            raise
        return True

    @classmethod
    def connect(cls, name: str, namespace: str = "memra", address: str = "auto") -> "Deployment":
        """Attach to a detached deployment by name (from any process that can reach its Ray cluster)."""
        owns = False
        if not ray.is_initialized():
            attach(address, namespace)
            owns = True
        elif ray.get_runtime_context().namespace != namespace:
            # (the handle finds its stages by name in this process's namespace: it looked in the wrong one, and
            # found another namespace's deployment of that name, or named the wrong namespace in its refusal)
            raise ConfigError(f"connect({name!r}, namespace={namespace!r}): this process is attached to Ray in "
                              f"namespace {ray.get_runtime_context().namespace!r}; a process's handles all use "
                              f"one namespace (connect from a process attached to {namespace!r})")
        deadline = time.monotonic() + cls.CONNECT_WAIT_S
        while True:
            try:
                first = ray.get_actor(f"{name}.stage0")
                d = _get(first.describe.remote(), 30, "describe")
                plan = Plan.from_dict(d["plan"])
                actors = [first] + [ray.get_actor(f"{name}.stage{i}") for i in range(1, len(plan.stages))]
                st = cls._recovery_state(name)
                if st is None or st["ready"] or st["failure"]:    # (a failed one: the handle's calls report it)
                    break
                why = f"it is restarting a stage ({st['reason']})"
            except (ValueError, StageFailed) as e:
                # a stage between its death and its replacement: its name is free for a moment, or the new actor is
                # not set up yet (this raised Ray's ValueError, or "no deployment named", during every recovery).
                # The deployment lives while its placement group does.
                st = cls._recovery_state(name)
                if st is not None and st["failure"]:        # no stage will come back: waiting is pointless
                    raise StageFailed(f"connect({name!r}): {st['failure']}", stage=st["stage"]) from None
                if _named_pg(name) is None:
                    if isinstance(e, StageFailed):
                        raise
                    where = ray.get_runtime_context().gcs_address
                    raise ConfigError(f"no deployment named {name!r} in namespace {namespace!r} on the Ray cluster "
                                      f"at {where}" + (" (found by `auto`: where several clusters run on this host, "
                                                       "pass the address `memra-pp launch` printed)"
                                                       if address == "auto" else "")) from None
                why = f"a stage is being replaced ({type(e).__name__}: {str(e).splitlines()[0]})"
            if time.monotonic() >= deadline:
                raise StageFailed(f"connect({name!r}): the deployment did not serve within {cls.CONNECT_WAIT_S:g} s: "
                                  f"{why}; connect again once `memra-pp status` shows it serving")
            time.sleep(0.2)
        infos = [{"vocab_size": d["vocab_size"], "eos": d["eos"]}]
        dep = cls(load_placement(d["placement"]), plan, actors, infos, None, owns, True)
        dep.connected = True        # (its tokenizer and model config: the intake's, at their first use)
        dep._pg_id = _named_pg_id(dep.placement.name)
        if dep._pg_id is not None:      # (whatever `recover`: a recovery in progress is waited for as launch's
            from .supervisor import RemoteSupervisor    # handle waits; with replay its clients replay as launch's do)
            dep.supervisor = RemoteSupervisor(dep)
            dep.supervisor.start()
        return dep

    CONNECT_WAIT_S = 60.0   # connect() waits this long for a deployment restarting a stage to serve again

    @staticmethod
    def _recovery_state(name: str) -> dict | None:
        """A detached deployment's recovery state as its launching supervisor publishes it (Supervisor._publish;
        None: no failure yet, or no such deployment)."""
        import json
        from ray.experimental import internal_kv
        pg_id = _named_pg_id(name)
        if pg_id is None:
            return None
        raw = internal_kv._internal_kv_get(kv_key(ray.get_runtime_context().namespace, name, pg_id, "recovery"))
        return json.loads(raw) if raw else None

    def kv_key(self, kind: str) -> bytes | None:
        """This detached deployment's `kind` key in the Ray KV ("stop", "recovery", "adapters": kv_key; None: not
        detached, or its group is not found)."""
        pg_id = self._pg.id.hex() if self._pg is not None else self._pg_id
        if not self.detached or pg_id is None:
            return None
        return kv_key(ray.get_runtime_context().namespace, self.placement.name, pg_id, kind)

    # -- use --------------------------------------------------------------------------------------------------
    def _require_up(self, what: str) -> None:
        if self._down:      # the actors are gone: a call would make Ray start a new local cluster to find them
            raise StageFailed(f"{what}: the deployment {self.placement.name!r} was shut down")
        if self._gone is not None:      # a connect()ed handle whose launch was shut down (refresh_actors)
            raise StageFailed(f"{what}: {self._gone}")
        if not ray.is_initialized():    # (ray.shutdown() by the caller): a call would start a new local cluster
            raise StageFailed(f"{what}: this process is no longer connected to the Ray cluster of the deployment "
                              f"{self.placement.name!r} (ray.shutdown() was called); connect() again")

    def client(self):
        self._require_up("client")
        from .client import Client
        self._forget_collected()
        c = Client(self)
        self._clients.add(c)
        c.forget_when_collected = weakref.finalize(c, self._forgotten.put, c.id)
        return c

    def _forget_collected(self) -> None:
        """The intake forgets the mailboxes of clients collected without close() (a client made per request
        and dropped: each kept its mailbox on the intake until shutdown). Not from the finalizer itself: a Ray
        call inside the garbage collector could meet Ray's own locks."""
        while True:
            try:
                cid = self._forgotten.get_nowait()
            except queue.Empty:
                return
            try:
                self.actors[0].forget_client.remote(cid)
            except Exception:  # noqa: BLE001 - the intake is gone: so is its mailbox
                pass

    @property
    def model_config(self):
        if getattr(self, "_mc", None) is None:
            if self.connected:
                self._remote_model()
            else:
                from .model.weights import open_weights
                m = self.placement.model
                self._mc = open_weights(m.path, m.format).config
        return self._mc

    def _remote_model(self) -> None:
        """A connected handle's model config and tokenizer: the intake's. The model directory is the deployment's;
        this process's host may not have it, or may hold another checkpoint at that path."""
        info = _get(self.actors[0].model_info.remote(), 60, "model info", stage=0)
        self._mc, self._tokenizer = info["config"], info["tokenizer"] or False

    @property
    def tokenizer(self):
        if self._tokenizer is None and self.connected:
            self._remote_model()
        if self._tokenizer is None:
            from .model.tokenizer import Tokenizer
            p = Path(self.placement.model.path).expanduser()
            self._tokenizer = Tokenizer.for_model(p, self.placement.model.format)
            if self._tokenizer is None:
                self._tokenizer = False
        return self._tokenizer or None

    # -- adapters (operator side: paths come from here, never from a client request) ----------------------------
    def load_adapter(self, name: str, path: str) -> int:
        """Load a PEFT adapter on every stage into a free slot; clients then select it by `name`. The intake's
        registry gives the slot and publishes the name once every stage holds it, so handles of one deployment
        (launch's, connect()'s) never share a slot or unload what another is loading."""
        self._require_up("load_adapter")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_ADAPTER_NAME or not name.isprintable() \
                or name != name.strip():
            raise InputError(f"an adapter's name is 1 to {MAX_ADAPTER_NAME} printable characters without leading or "
                             f"trailing spaces (it is shown in logs and errors), got {_clip(name)}")
        name = str.__str__(name)    # (a str subclass's own string, a (str, Enum) member's value: what a stage
        #                            can unpickle; str() of a (str, Enum) member is its "Cls.NAME")
        fs = os.fspath(path) if isinstance(path, os.PathLike) else path
        if not isinstance(fs, str):     # (bytes, or a path-like giving bytes)
            raise InputError(f"adapter {name!r}: its path is a str or os.PathLike of a str, got {_clip(path)}")
        # absolute here: each stage reads the path from its own working directory, not the caller's
        path = str(Path(fs).expanduser().absolute())
        t = Limit.of(self.placement.timeouts, "ready_s")
        with self._between_recoveries(f"load_adapter({name!r})"):
            self.refresh_actors()       # a connect()ed handle: the stages as they are now (after any restart)
            slot = _get(self.actors[0].reserve_adapter.remote(name, path), t, "reserve an adapter slot",
                        refused=ConfigError)
            try:
                # (a live stage that raised something not ours refused this adapter: ConfigError, no stage lost)
                digests = _get([a.load_adapter.remote(name, path, slot) for a in self.actors], t,
                               f"load adapter {name!r}", refused=ConfigError)
                if len(set(digests)) > 1:   # each stage reads the files itself: they changed between the reads
                    raise ConfigError(f"adapter {name!r}: its files at {path} changed while the stages read them "
                                      f"(the stages read {len(set(digests))} different adapters); load it again "
                                      f"once they are written")
                _get(self.actors[0].commit_adapter.remote(name, slot), t, "publish the adapter's name")
            except BaseException:
                try:
                    _get([a.unload_adapter.remote(slot) for a in self.actors], t, "unload after a failed load")
                finally:
                    try:
                        _get(self.actors[0].release_adapter.remote(name), t, "release the adapter slot")
                    finally:
                        # a first load makes each stage's LoRA pools before it checks the weights into them: a
                        # refused one leaves the pools, whose memory the KV budget must not count on
                        with contextlib.suppress(MemraError):
                            self._rebudget(t)
                raise
            self._rebudget(t)            # the first load made LoRA pools: the KV budget shrinks by what they took
            self.saw_adapters(*_get(self.actors[0].adapters_seen.remote(), t, "adapters"))
        return slot

    def saw_adapters(self, seq: int, adapters: dict) -> None:
        """The intake's loaded adapters at registry version `seq` (adapters_seen): kept if newer than what this handle
        has (a heartbeat read before a load's commit can arrive after the load's own read)."""
        if seq > self._adapter_seq:
            self._adapter_seq, self._adapter_paths = seq, adapters

    @contextlib.contextmanager
    def _between_recoveries(self, what: str):
        """An adapter load or unload runs on every stage, so not across a recovery, which replaces stages under it:
        a load during one reached the new actor before its setup (a Ray traceback of an AttributeError) and the
        adapter was lost. Waits for a recovery in progress (timeouts.ready_s) and holds this process's supervisor
        lock, so that none starts meanwhile: a stage lost during the load fails it with StageFailed, and then the
        recovery runs. (A connect()ed handle can only wait for the launcher's recovery to end.)"""
        sup, t = self.supervisor, self.placement.timeouts.ready_s
        lock = getattr(sup, "lock", None)
        if lock is not None and not lock.acquire(timeout=t):
            raise StageFailed(f"{what}: a stage recovery did not end within {t:g} s (timeouts.ready_s); retry once "
                              f"dep.wait_ready() returns")
        try:
            if sup is not None and not sup.ready.wait(t):
                raise sup.failure or StageFailed(f"{what}: the deployment did not recover within {t:g} s "
                                                 f"(timeouts.ready_s); retry once dep.wait_ready() returns")
            if sup is not None and sup.failure is not None:     # a recovery gave up: no stage set to load on
                raise sup.failure
            self._require_up(what)      # (shut down while this waited)
            yield
        finally:
            if lock is not None:
                lock.release()

    def _rebudget(self, t: float) -> None:
        """Measure every stage's KV memory again and give the intake the new budget (admissions already made keep
        their pages; new ones wait until the budget has room)."""
        pages, _ = _measure_kv(self.actors, t, self.placement.scheduler.kv_pages)
        _get(self.actors[0].set_kv_pages.remote(max(1, pages)), t, "KV budget")

    def unload_adapter(self, name: str) -> None:
        self._require_up("unload_adapter")
        if not isinstance(name, str):
            raise InputError(f"unknown adapter {name!r}: an adapter's name is a string")
        name = str.__str__(name)    # (a str subclass: as load_adapter)
        t = Limit.of(self.placement.timeouts, "ready_s")
        with self._between_recoveries(f"unload_adapter({name!r})"):
            self.refresh_actors()       # a connect()ed handle: the stages as they are now (after any restart)
            slot = _get(self.actors[0].begin_unload.remote(name), t, "withdraw the adapter's name")   # no new use
            try:
                users = _get(self.actors[0].adapter_users.remote(slot), t, "adapter users")
            except BaseException:
                _get(self.actors[0].abort_unload.remote(name), t, "publish the adapter's name again")
                raise
            if users:   # unloading now would change the weights under requests still generating with them
                _get(self.actors[0].abort_unload.remote(name), t, "publish the adapter's name again")
                raise InputError(f"adapter {name!r} is still used by {users} request(s); unload it when they finish")
            try:
                _get([a.unload_adapter.remote(slot) for a in self.actors], t, f"unload adapter {name!r}")
            finally:    # withdrawn: its slot is free even where a stage failed midway (a load clears a slot first)
                _get(self.actors[0].release_adapter.remote(name), t, "release the adapter slot")
            self.saw_adapters(*_get(self.actors[0].adapters_seen.remote(), t, "adapters"))

    def refresh_actors(self) -> bool:
        """A connect()ed handle: look the stage actors up by name again, since the launching process's supervisor
        replaces a failed stage with a new actor of the same name (launch's own handle is updated by its
        supervisor). Returns whether the handles were looked up."""
        if not self.connected or self._down or not ray.is_initialized():
            return False
        found: list = []

        def look():     # ray.get_actor waits for the GCS as long as it takes (a killed launcher's cluster: until
            try:        # Ray ends this process, 60 s on): the caller waits REFRESH_S at most
                actors = [ray.get_actor(f"{self.placement.name}.stage{i}") for i in range(len(self.plan.stages))]
            except Exception:  # noqa: BLE001 - a stage between its kill and its replacement, the GCS slow: not now
                actors = None
            try:    # (after the actors: a launch that took the name meanwhile is found)
                pg = _named_pg_id(self.placement.name)
            except Exception:  # noqa: BLE001 - the GCS slow or gone: not now
                return
            if self._pg_id is not None and pg != self._pg_id:
                # this handle's launch is gone: its calls fail from now on, and a later launch of the name (another
                # placement, maybe another model, a recovery record this handle does not follow) never serves them
                self._gone = (f"the deployment {self.placement.name!r} this handle connected to was shut down"
                              + ("; a later launch has its name: connect() to it" if pg else ""))
            elif actors is not None:
                found.append(actors)
        t = threading.Thread(target=look, name="refresh-actors", daemon=True)
        t.start()
        t.join(self.REFRESH_S)
        if not found:
            return False
        with self._actors_lock:
            self.actors = found[0]
        return True

    REFRESH_S = 5.0     # refresh_actors' longest wait for the cluster's answer

    def stage_actor(self, i: int):
        return self.actors[i]

    def stats(self, reset: bool = False, timeline: bool = False) -> dict:
        """Per stage counters; `timeline`: also each stage's most recent microbatch spans, [kind, tokens, start,
        end] on the node's CLOCK_MONOTONIC (time.monotonic) seconds, device time on a GPU (stages/timeline.py)."""
        self._require_up("stats")
        from .request import flag       # ("no" is truthy: it reset the counters)
        reset, timeline = flag("stats: reset", reset), flag("stats: timeline", timeline)
        try:
            st = _get([a.stats.remote(reset, timeline) for a in self.actors], self.placement.timeouts.step_s,
                      "stats")
        except StageFailed:
            self.refresh_actors()       # a connect()ed handle: the next call asks the restarted stages
            raise
        return {"stages": st}

    def wait_ready(self, timeout: float | None = 60.0) -> None:
        """Return once every stage serves (after a recovery: once it completed); StageFailed if not in time.
        timeout: seconds >= 0, or None (as long as it takes)."""
        if timeout is None:
            timeout = MAX_TIMEOUT_S
        # (None raised a TypeError and NaN a ValueError from deep inside; a negative wait is a caller's mistake)
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:
            raise InputError(f"wait_ready: timeout is seconds >= 0 or None (as long as it takes), got {_clip(timeout)}")
        timeout = min(float(timeout), MAX_TIMEOUT_S)
        self._require_up("wait_ready")
        if self.supervisor is not None:
            return self.supervisor.wait_ready(timeout)
        _get([a.ping.remote() for a in self.actors], timeout, "wait_ready")

    def shutdown(self, stop_ray: bool = True) -> None:
        """Stop every stage and free the placement group; stop Ray too if this deployment started it
        (unless `stop_ray` is False: the caller still needs the cluster, e.g. to tell a waiting `stop`). A second
        call only stops Ray where the first left it up."""
        self._down = True                 # refuse every later call, also while this one tears down
        with self._shutdown_lock:         # (a second caller returns once the first has torn everything down)
            if not self._torn_down:
                if self.connected:
                    self.stopped_by = self._stop_remote()
                else:
                    self._teardown()
                self._torn_down = True    # (a teardown that raised, e.g. on Ctrl-C, runs again on the next call)
            _LIVE.discard(self)
            if self.owns_ray and stop_ray and ray.is_initialized():
                others = [d for d in list(_LIVE) if not d._down]
                if others:  # another handle of this process still uses the cluster: it stops Ray when it goes
                    others[0].owns_ray = True
                else:
                    ray.shutdown()

    def _stop_remote(self, wait_s: float | None = None) -> str:
        """A connect()ed handle's shutdown: ask the launching process (its supervisor) to shut the deployment down,
        which stops its restarts first; where none answers within `wait_s` (default: 20 s beyond the supervisor's
        longest check), kill the stages and remove the placement group from here, if they are still the ones this
        handle connected to. Returns who stopped it: "launcher", "killed", or "gone" (another launch by now)."""
        import time
        from ray.experimental import internal_kv
        from .supervisor import MISSED_BEATS
        if self.supervisor is not None:       # a RemoteSupervisor: nothing more to follow
            self.supervisor.stop()
        for c in list(self._clients):     # (a closed client leaves the list)
            c.close()
        if not ray.is_initialized():      # ray.shutdown() here: a Ray call would start a new local cluster
            raise StageFailed(f"shutdown: this process is no longer connected to the Ray cluster of the deployment "
                              f"{self.placement.name!r} (ray.shutdown() was called), so it could not stop it; this "
                              f"handle is closed: connect() again and shut it down from there")
        key = self.kv_key("stop")
        if key is None or _named_pg_id(self.placement.name) != self._pg_id:
            return "gone"
        internal_kv._internal_kv_put(key, b"1")     # stays set while unanswered: a supervisor restarts nothing
        hb = self.placement.timeouts.heartbeat_s
        deadline = time.monotonic() + (wait_s if wait_s is not None else 20.0 + 2 * MISSED_BEATS * hb + 1.0)
        while time.monotonic() < deadline:
            if internal_kv._internal_kv_get(key + b":done"):
                for k in (key, key + b":done"):
                    internal_kv._internal_kv_del(k)
                return "launcher"
            time.sleep(0.05)        # (the launcher waits for this read before its cluster goes: cli.await_stop_read)
        if _named_pg_id(self.placement.name) != self._pg_id:   # a new launch took the name meanwhile
            return "gone"
        self._teardown()
        return "killed"

    def _teardown(self) -> None:
        if self.supervisor is not None:   # first: no restart may race the teardown
            self.supervisor.stop()
        for c in list(self._clients):     # (a closed client leaves the list)
            c.close()
        with self._actors_lock:
            actors = list(self.actors)
        if not ray.is_initialized():      # ray.shutdown() by the caller: a Ray call would start a new local cluster
            self._teardown_without_ray()
            return
        refs = [a.stop.remote() for a in actors]
        # a dead or hung stage must not keep the others up; one that answered (an error or a dead actor's answer
        # too) goes by Ray's kill, one that did not by its process where it is here (Ray waits ~5 s for it)
        answered = set(ray.wait(refs, num_returns=len(refs), timeout=10)[0])
        for i, (a, ref) in enumerate(zip(actors, refs)):
            if ref in answered:
                ray.kill(a)
            else:
                kill_actor(a, self.procs.get(i))
        # a restart that outlived stop()'s wait (a weights reload, say) must end before Ray may: its next Ray call
        # after ray.shutdown() would start a new local cluster. Its calls on the killed stages now fail, and it
        # ends at its next step (an actor it makes from here on it kills itself)
        if self.supervisor is not None and not self.supervisor.finish(self.placement.timeouts.step_s):
            log.warning(f"shutdown: the recovery of {self.placement.name!r} did not end within "
                        f"{self.placement.timeouts.step_s:g} s (timeouts.step_s) of its stages' end")
        unlink_shm([n for names in self.slot_names for n in names])   # what a killed stage could not (this host)
        from ray.util.placement_group import remove_placement_group
        pg = getattr(self, "_pg", None)
        if pg is None and self.connected:     # the launching process's detached group, found by its name
            pg = _named_pg(self.placement.name)
            if pg is not None and pg.id.hex() != self._pg_id:   # another launch's: not this handle's to remove
                pg = None
        if pg is not None:
            remove_placement_group(pg)
        if self.detached:     # this launch's keys in Ray's KV (the stop key is cleared by whoever asked)
            from ray.experimental import internal_kv
            for kind in ("recovery", "adapters"):
                key = self.kv_key(kind)
                try:
                    if key is not None:
                        internal_kv._internal_kv_del(key)
                except Exception:  # noqa: BLE001 - the cluster is going away: nothing left to clear
                    pass
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _teardown_without_ray(self) -> None:
        """What _teardown frees where this process has left Ray: the stage processes still running on this host
        (Ray stops a stage with the cluster its driver started, or with the driver it belongs to; a detached one
        stays) are SIGKILLed by their pid, then their shared-memory segments and the run dir go."""
        from .rayutil import _pidns, _sigkill
        pids = []
        host = socket.gethostname()
        for proc in self.procs.values():    # (only this host's: its name, its pid namespace, the process's start)
            if proc.get("start") is not None and proc.get("host") == host and proc.get("pidns") == _pidns():
                _sigkill(proc["pid"], proc["start"])
                pids.append(proc["pid"])
        unlink_shm([n for names in self.slot_names for n in names])
        unlink_shm_of(pids)
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _require_fits(stages) -> None:
    """The stages' CPUs go in one placement group packed on one node: one that no node of the cluster has room for
    can never be placed, and pg.ready() waited timeouts.ready_s (300 s by default) to say only "no answer"."""
    need = sum(s.num_cpus for s in stages)
    nodes = [n.get("Resources", {}).get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
    if nodes and need > max(nodes) + 1e-9:
        each = ", ".join(f"stages[{i}] {s.num_cpus:g}" for i, s in enumerate(stages))
        raise ConfigError(f"stages[*].num_cpus: the stages need {need:g} CPUs on one node ({each}), and the largest "
                          f"node of this Ray cluster has {max(nodes):g}; lower num_cpus (a fraction is fine: a stage "
                          f"sizes its own threads) or add a node that large")


def _measure_kv(actors, t: float, limit: int | None) -> tuple[int, list[dict]]:
    """(the KV pages every stage can hold now, the stages' reports): one fan-out of kv_report, then kv_budget."""
    from .model.kv_memory import kv_budget
    reports = _get([a.kv_report.remote() for a in actors], t, "KV memory")
    return kv_budget(reports, limit), reports
