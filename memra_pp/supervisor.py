"""The driver's supervisor: heartbeats every stage, declares a dead, silent or loop-dead stage failed, tells the
clients (they fail or replay their requests), restarts the stage in its placement-group bundle and rewires.
Runs as one thread in the process that launched the deployment.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref

import ray
from ray.experimental import internal_kv

from .errors import ConfigError, InputError, StageFailed
from .rayutil import Limit, get as _get, kill_actor
from .shm import shm_names

log = logging.getLogger("memra_pp")
MISSED_BEATS = 3          # a stage silent for this many heartbeats is declared failed
STOP_POLL_S = 0.1         # a detached deployment's stop request is looked for this often (a Ray KV read), not
#                           only at each heartbeat (2 s by default: `memra-pp stop` waited for it)
ATTEMPTS = 3              # restarts tried per failure before the deployment gives up (wait_ready raises)


class Supervisor:
    def __init__(self, dep):
        self.dep = dep
        self.lock = threading.Lock()          # one recovery at a time
        self.stopping = threading.Event()
        self.ready = threading.Event()        # set while the deployment serves; cleared during a recovery
        self.ready.set()
        self.generation = 0                   # bumped at every detected failure
        self.recovered = 0                    # the generation of the last completed recovery
        self.failure: StageFailed | None = None   # set when a recovery gave up: wait_ready raises it
        self.log: list[dict] = []             # one record per failure: stage, reason, detect / recovery times
        self.sigkilled = 0                    # stage processes a restart SIGKILLed itself (rayutil.kill_actor)
        self.halt_failed: dict[int, str] = {}   # the last recovery's survivors whose halt failed: index -> why
        self.reload_from: str | None = None   # where the last restart read its adapters: intake, kv or heartbeat
        # each stage's actor as the last completed restart (or the launch) left it: one a failed attempt made since
        # is not the deployment's (it holds no adapters, and an intake's registry is not the deployment's)
        self.actor_ids = [a._actor_id for a in dep.actors]
        self.thread = threading.Thread(target=self._run, name="memra-supervisor", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop supervising. A recovery in progress stops at its next step (an actor it creates after this is
        killed by it); the caller then tears down every actor, so this waits only briefly."""
        self.stopping.set()
        if not self.ready.is_set():
            self._end_stopped()
        self.finish(self.STOP_JOIN_S)

    # how long stop() waits for a recovery to reach its next step (finish() waits again once the stages are gone)
    STOP_JOIN_S = 10.0

    def finish(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the supervising thread to end (from another thread); whether it has."""
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=timeout)
        return not self.thread.is_alive()

    def _end_stopped(self) -> None:
        """A recovery ended by a shutdown: callers waiting for it get a typed error, not timeouts.ready_s of waiting
        (a stop that came between the recovery's check and its clearing `ready` found it still set)."""
        self.failure = self.failure or StageFailed("the deployment was shut down during a recovery")
        self.ready.set()

    def wait_ready(self, timeout: float) -> None:
        """Return once every stage answers and no recovery is pending; a failure not detected yet is waited out
        (the next heartbeat finds it and the recovery runs). StageFailed if that does not happen in time."""
        def check():
            if self.stopping.is_set():      # (its stages answer no more: this looped, without a pause, to the end)
                raise StageFailed("wait_ready: the deployment was shut down while this waited")
        await_ready(self, timeout, check, lambda left: stages_serve(self.dep, left),
                    min(self.dep.placement.timeouts.heartbeat_s, 0.2))

    # -- detection ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        hb = self.dep.placement.timeouts.heartbeat_s
        poll = min(hb, STOP_POLL_S) if self.dep.detached else hb
        beat = time.monotonic() + hb            # the next heartbeat: a period after the last one's end
        while not self.stopping.wait(max(0.0, min(poll, beat - time.monotonic()))):
            if not ray.is_initialized():    # ray.shutdown() here without dep.shutdown(): a Ray call from this
                return                      # thread would start a new local cluster (Ray's auto-init)
            if self.dep.detached and self._stop_requested():
                return
            if time.monotonic() < beat:
                continue
            if self.failure is not None:
                beat = time.monotonic() + hb
                continue
            try:
                bad = self.check(hb * MISSED_BEATS)
                if bad is not None and not self.stopping.is_set():
                    self.recover(*bad)
            except Exception as e:  # the supervisor must never die silently with `ready` cleared
                log.exception("supervisor: recovery failed")
                self.failure = StageFailed(f"the supervisor failed while recovering: {type(e).__name__}: {e}")
                for c in list(self.dep._clients):      # what is held for a replay will not get one
                    c.on_recovery_failed(self.failure)
                self.ready.set()
            beat = time.monotonic() + hb

    def _publish(self, stage: int, reason: str) -> None:
        """A detached deployment's recovery state, for connect()ed handles (RemoteSupervisor): the generation of
        the last failure, the last one recovered, whether it serves, and a recovery's failure."""
        if not self.dep.detached:
            return
        try:
            internal_kv._internal_kv_put(self.dep.kv_key("recovery"), json.dumps(
                {"generation": self.generation, "recovered": self.recovered, "ready": self.ready.is_set(),
                 "stage": stage, "reason": reason,
                 "failure": None if self.failure is None else str(self.failure)}).encode())
        except Exception:  # noqa: BLE001 - connected handles then see the loss through their own calls
            log.exception("supervisor: could not publish the recovery state")

    def _stop_requested(self) -> bool:
        """A detached deployment asked to stop (`memra-pp stop`, a connect()ed handle's shutdown): shut it down
        from another thread (shutdown stops this one) and say so under the key's `:done`."""
        if self.stopping.is_set():
            return False
        try:
            key = self.dep.kv_key("stop")
            if key is None or not internal_kv._internal_kv_get(key):
                return False
        except Exception:  # noqa: BLE001 - the cluster is going away: nothing to answer
            return False
        log.warning(f"stop requested: shutting {self.dep.placement.name!r} down")
        self.stopping.set()               # no restart from here on

        def stop():
            try:
                self.dep.shutdown(stop_ray=False)
                self.dep.stop_ok = True
            except Exception:  # noqa: BLE001 - the asker falls back to killing the stages; the launcher exits
                log.exception("stop requested: the shutdown failed")
            finally:
                self.dep.stop_done.set()      # (before the answer: whoever reads it sees the handle stopped)
            if self.dep.stop_ok:
                internal_kv._internal_kv_put(key + b":done", b"1")
        threading.Thread(target=stop, name="memra-stop", daemon=True).start()
        return True

    def check(self, timeout: float, confirm: bool = True) -> tuple[int, str] | None:
        """(stage, reason) of the failed stage to blame, or None. A dead or silent actor outranks a loop that
        died of its own error, which outranks a loop that ended because a neighbour's link closed."""
        actors = list(self.dep.actors)
        refs = [a.health.remote() for a in actors]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        dead, broken, lost = [], [], []
        for i, ref in enumerate(refs):
            if ref not in done:
                dead.append((i, f"did not answer a heartbeat within {timeout:.3g} s"))
                continue
            try:
                h = ray.get(ref, timeout=0)
            except Exception as e:  # RayActorError and friends: the process is gone
                dead.append((i, f"its actor died ({type(e).__name__})"))
                continue
            if "adapters" in h:     # the intake's loaded adapters, every handle's: what a restart of it reloads
                self.dep.saw_adapters(h["adapters_seq"], h["adapters"])
            if not h["alive"]:
                (lost if h["lost_link"] else broken).append(
                    (i, f"its loop ended: {(h['error'] or 'a link to a neighbour closed').strip().splitlines()[-1]}"))
            elif h.get("computing_s", 0.0) > self.dep.placement.timeouts.step_s:   # answers, but is stuck
                dead.append((i, f"one microbatch has been computing for {h['computing_s']:.1f} s, more than "
                                f"timeouts.step_s ({self.dep.placement.timeouts.step_s:g} s)"))
        if dead:
            return dead[0]
        if broken:
            return broken[0]
        if lost:   # a neighbour may be dying right now: give Ray a moment to report it, then blame the first
            time.sleep(min(timeout, 1.0))
            again = self.check(timeout, confirm=False) if confirm and not self.stopping.is_set() else None
            return again or lost[0]
        return None

    # -- recovery -----------------------------------------------------------------------------------------------
    def recover(self, stage: int, reason: str) -> None:
        dep = self.dep
        with self.lock:
            if self.stopping.is_set() or (dep.detached and self._stop_requested()):   # stopped, not failed
                return
            t0, k0 = time.monotonic(), self.sigkilled
            self.ready.clear()
            self.generation += 1
            err = StageFailed(f"stage {stage} failed: {reason}", stage=stage)
            self._publish(stage, str(err))
            log.warning(f"{err}; restarting it")
            for c in list(dep._clients):
                c.on_stage_failed(err)
            last, self.halt_failed = None, {}       # (every attempt's survivors whose halt failed)
            for attempt in range(ATTEMPTS):
                if self.stopping.is_set() or not ray.is_initialized() or (dep.detached and self._stop_requested()):
                    self._end_stopped()
                    return
                try:
                    self._restart(stage, err, attempt)
                    break
                except Exception as e:  # noqa: BLE001 - any failure to restart is retried, then reported
                    if self.stopping.is_set() or not ray.is_initialized():     # a shutdown ended it, not a failure
                        self._end_stopped()
                        return
                    last = e
                    log.warning(f"restart of stage {stage} failed (attempt {attempt + 1}): {e}")
            else:
                self.failure = StageFailed(f"stage {stage} failed ({reason}) and could not be restarted in "
                                           f"{ATTEMPTS} attempts: {type(last).__name__}: {last}; shut the deployment "
                                           f"down and launch it again once that is fixed", stage=stage)
                self.log.append({"stage": stage, "reason": reason, "recovered": False, "attempts": ATTEMPTS})
                for c in list(dep._clients):
                    c.on_recovery_failed(self.failure)
                self.ready.set()
                self._publish(stage, str(err))
                return
            self.recovered = self.generation
            self.log.append({"stage": stage, "reason": reason, "recovered": True,
                             "recovery_s": time.monotonic() - t0, "attempts": attempt + 1,
                             "sigkilled": self.sigkilled - k0, "halt_failed": self.halt_failed})
            self.ready.set()
            self._publish(stage, str(err))
            for c in list(dep._clients):
                c.on_recovered()

    def _restart(self, stage: int, err: StageFailed, attempt: int = 0) -> None:
        """Kill the failed actor, halt the survivors, start a new actor in the same bundle, reload its weights,
        open every receiving side afresh in a new run sub-dir (one per attempt), rewire, reload adapters, start."""
        dep, p = self.dep, self.dep.placement
        t = Limit.of(p.timeouts, "ready_s")
        self._live()
        # its process first where it runs here: Ray waits about 5 s for one that does not answer (a hung or stopped
        # stage), and the new actor waits for its bundle
        self.sigkilled += kill_actor(dep.actors[stage], dep.procs.get(stage))
        survivors = [i for i in range(len(dep.actors)) if i != stage]
        self._live()
        refs = [dep.actors[i].halt.remote(stage, str(err)) for i in survivors]
        ray.wait(refs, num_returns=len(refs), timeout=p.timeouts.step_s)
        failed = {stage}
        for i, ref in zip(survivors, refs):
            # restarted too: a survivor that cannot halt, and a stage a failed attempt made and left half reloaded
            # (relinked only, it never loaded the adapters and served them without their LoRA; an intake's
            # registry is not the deployment's)
            try:
                ray.get(ref, timeout=0)
                again = dep.actors[i]._actor_id != self.actor_ids[i]
            except Exception as e:  # noqa: BLE001
                cause = getattr(e, "cause", None) or e      # (a RayTaskError carries the stage's own exception)
                self.halt_failed[i] = f"{type(cause).__name__}: {cause}"
                again = True
            if again:
                self.sigkilled += kill_actor(dep.actors[i], dep.procs.get(i))
                failed.add(i)
        # one sub-dir per attempt: a failed attempt leaves the sockets its stages opened (a stage lost during the
        # restart), and a retry in the same dir was refused ("channel socket ... exists") every time after
        run_dir = os.path.join(dep.run_dir, f"r{self.generation}-{len(self.log)}-{attempt}")
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        for i in sorted(failed):
            self._live()
            a = dep.new_actor(i)
            with dep._actors_lock:
                dep.actors[i] = a
            dep.procs.pop(i, None)      # (a retry must not aim at the dead one)
            if self.stopping.is_set():
                ray.kill(a)
                raise StageFailed("the deployment is shutting down")
        # the new processes, named before their setup (a weights load): a shutdown after ray.shutdown() kills a
        # stage by its pid, and a detached one it could not name stayed running
        self._live()
        new = sorted(failed)
        for i, proc in zip(new, _get([dep.actors[i].proc.remote() for i in new], t, "new stage processes")):
            if proc:
                dep.procs[i] = proc
        self._live()
        stale = {i: dep.slot_names[i] for i in failed if dep.slot_names[i]}
        if stale:   # a killed stage left its receiving segments behind: its replacement (same node) unlinks them
            _get([dep.actors[i].unlink_shm.remote(names) for i, names in stale.items()], t, "stale slots")
        tr = dep.transports
        infos = _get([a.setup.remote(p.to_dict(), dep.plan.to_dict(), i, run_dir, tr[i], dep.switches) if i in failed
                      else a.relink.remote(run_dir, tr[i]) for i, a in enumerate(dep.actors)], t, "stage restart")
        dep.slot_names = [shm_names(x) for x in infos]
        self._live()
        dep.wire(dep.actors, infos, t)
        # the adapters to reload: the loaded ones of the intake's registry where the intake survived (every
        # handle's loads); else as the dead intake last kept them in Ray's KV (a detached deployment, where other
        # handles load too), or as the last heartbeat saw them. A new intake's registry is filled again here. One
        # that no longer loads (its files gone) is dropped and logged, not a failed restart.
        self._live()
        if 0 in failed:
            loaded, self.reload_from = self._kept_registry(), "kv"
            if loaded is None:
                loaded, self.reload_from = dep._adapter_paths, "heartbeat"
        else:
            loaded, self.reload_from = _get(dep.actors[0].adapters.remote(True), t, "adapters"), "intake"
        kept = {}
        for name, (slot, path) in loaded.items():
            self._live()
            try:
                if 0 in failed:
                    _get(dep.actors[0].reserve_adapter.remote(name, path, slot), t, "reserve adapter slot")
                got = _get([dep.actors[i].load_adapter.remote(name, path, slot) for i in sorted(failed)], t,
                           f"reload adapter {name!r}")
                self._same_adapter(path, slot, failed, got, t)
                if 0 in failed:
                    _get(dep.actors[0].commit_adapter.remote(name, slot), t, "publish the adapter's name")
                kept[name] = (slot, path)
            except (ConfigError, InputError, OSError) as e:    # its files, not a stage failing again
                log.warning(f"adapter {name!r} (slot {slot}, {path}) could not be reloaded and is dropped: {e}")
                # its name first (no new request selects it; the halt ended the ones that had), then its weights
                # wherever they are, then its slot
                _get(dep.actors[0].release_adapter.remote(name), t, "release the adapter slot")
                if 0 not in failed:
                    _get([a.unload_adapter.remote(slot) for a in dep.actors], t, "unload a dropped adapter")
        dep._adapter_paths = kept
        if 0 in failed:     # a new intake numbers its registry's versions from 0
            dep._adapter_seq = -1
        key = dep.kv_key("adapters") if 0 in failed else None
        if key is not None:     # only now: a reload that fails midway (and is retried) leaves the dead intake's list
            _get(dep.actors[0].registry_key.remote(key), t, "adapter registry key")
        self._live()
        if loaded:      # reloaded LoRA pools took memory after the wiring measured it
            dep._rebudget(t)
        self._live()
        _get([a.start.remote(recovered=True) for a in dep.actors], t, "stage start")
        self.actor_ids = [a._actor_id for a in dep.actors]

    def _live(self) -> None:
        """Before each of a restart's Ray calls: stop the restart once shutdown() has begun. Its stop() waits only
        10 s for the restart, then the caller tears down and may stop Ray; a Ray call after that would start a new
        local cluster (Ray's auto-init) and leave it running."""
        if self.stopping.is_set() or not ray.is_initialized():
            raise StageFailed("the deployment is shutting down")

    def _same_adapter(self, path: str, slot: int, failed, got: list, t: float) -> None:
        """The restarted stages read the adapter's files again: what they read must be what the surviving stages
        hold (their digests, adapters.content_digest), or the adapter would run as two (files rewritten in place
        since the load, as a trainer saving its next checkpoint to the same directory does). ConfigError: the
        caller drops it."""
        dep = self.dep
        survivors = [i for i in range(len(dep.actors)) if i not in failed]
        if not survivors:       # every stage read the files now: one adapter, whatever they hold
            if len(set(got)) > 1:
                raise ConfigError(f"its files at {path} changed while the restarted stages read them")
            return
        held = _get(dep.actors[survivors[0]].adapter_digest.remote(slot), t, "adapter digest")
        if any(g != held for g in got):
            raise ConfigError(f"its files at {path} changed since it was loaded: the restarted stage(s) "
                              f"{sorted(failed)} read other weights (sha256 {got[0][:12]}) than stage "
                              f"{survivors[0]} holds ({str(held)[:12]}); load it again to serve the new files")

    def _kept_registry(self) -> dict | None:
        """The loaded adapters a detached deployment's intake kept in Ray's KV, name -> (slot, path); None: not
        detached, nothing kept, or unreadable."""
        key = self.dep.kv_key("adapters")
        try:
            raw = internal_kv._internal_kv_get(key) if key is not None else None
            return None if raw is None else {n: (int(e[0]), str(e[1])) for n, e in json.loads(raw).items()}
        except Exception:  # noqa: BLE001 - unreadable or malformed: fall back to the heartbeat's copy
            log.exception("supervisor: could not read the adapter registry kept in Ray's KV")
            return None


def stages_serve(dep, left: float) -> bool:
    """wait_ready's ask: does every stage of `dep` serve (its health: it answers, and its loop runs)? Waits up to
    `left` s (at least 0.1, at most MISSED_BEATS heartbeats)."""
    beat = dep.placement.timeouts.heartbeat_s
    h = _get([a.health.remote() for a in list(dep.actors)], max(min(left, beat * MISSED_BEATS), 0.1), "wait_ready")
    return all(x["alive"] for x in h)


def await_ready(sup, timeout: float, check, ask, pause: float) -> None:
    """wait_ready's loop, for Supervisor and RemoteSupervisor `sup` (its `ready`, `failure` and `stopping`): wait
    until `sup` is ready, raise its failure, `check()` (raises what ends the wait at once), then `ask(seconds left)`
    the stages: True, and they serve. A StageFailed from the ask, or a False, is a failure not detected yet: asked
    again after `pause` until the deadline, when it is raised."""
    deadline = time.monotonic() + timeout
    while True:
        if not sup.ready.wait(max(deadline - time.monotonic(), 0)):
            raise sup.failure or StageFailed(f"the deployment did not recover within {timeout:g} s")
        if sup.failure is not None:
            raise sup.failure
        check()
        serving = None
        try:
            serving = ask(deadline - time.monotonic())
            if serving and sup.ready.is_set():
                return
        except StageFailed:
            if time.monotonic() >= deadline:
                raise
        if time.monotonic() >= deadline:    # (a stage that answers but does not serve, the failure not yet seen)
            raise sup.failure or StageFailed(f"the deployment did not recover within {timeout:g} s" +
                                             (": a stage's loop is not running" if serving is False else ""))
        sup.stopping.wait(pause)


def is_stage_lost(err: tuple | None) -> bool:
    """An error event that names a lost stage (a replay deployment's clients replay such requests)."""
    return err is not None and len(err) > 2 and err[2] is not None


class RemoteSupervisor:
    """A connect()ed handle's view of the launching process's supervisor: its generation (failures seen), the last
    generation recovered, whether the deployment serves and a recovery's failure, read every 0.2 s from the Ray KV
    key that supervisor publishes (Supervisor._publish). While a recovery runs, this handle's submits, adapter loads
    and unloads and wait_ready wait for it, as launch's own do; on a failure its clients fail their requests, or with
    `recover: replay` hold them, and on a completed recovery it looks the new stages up and they replay. Has what
    Client and ReplayMixin read of a Supervisor."""

    POLL_S = 0.2
    UNREACHABLE_S = 10.0    # the launch's cluster unreachable this long, with requests held: they fail

    def __init__(self, dep):
        self.dep = dep
        self.ready = threading.Event()
        self.ready.set()
        self.generation = self.recovered = 0
        self.failure: StageFailed | None = None
        self.stopping = threading.Event()
        self._unreachable_since: float | None = None     # the launch's cluster unreachable since (_launch_gone)
        # (the thread holds this by a weak reference: a connected handle let go, and this with it, ends it)
        self.thread = threading.Thread(target=RemoteSupervisor._follow, args=(weakref.ref(self), self.stopping),
                                       name="memra-remote-supervisor", daemon=True)
        st = self._read()
        if st is not None:      # where the launcher stands now
            self.generation, self.recovered = st["generation"], st["recovered"]
            if st["failure"]:
                self.failure = StageFailed(st["failure"], stage=st["stage"])
            elif not st["ready"]:
                self.ready.clear()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)

    def finish(self, timeout: float) -> bool:
        """As Supervisor.finish: wait up to `timeout` s for the following thread to end; whether it has."""
        return Supervisor.finish(self, timeout)

    def _read(self) -> dict | None:
        if not ray.is_initialized():    # (kv_key's get_runtime_context would start a new local cluster)
            return None
        try:
            raw = internal_kv._internal_kv_get(self.dep.kv_key("recovery"))
        except Exception:  # noqa: BLE001 - the cluster is going away
            return None
        return json.loads(raw) if raw else None

    @staticmethod
    def _follow(ref, stopping: threading.Event) -> None:
        """The thread: a round every POLL_S while the RemoteSupervisor `ref` names lives (no strong reference to it,
        or to its handle, is held across the wait)."""
        checked = time.monotonic()
        while not stopping.wait(RemoteSupervisor.POLL_S):
            sup = ref()
            if sup is None:
                return
            checked = sup._round(checked)
            del sup
            if checked is None:
                return

    def _round(self, checked: float) -> float | None:
        """One read of the launcher's record: what it changed, told to this handle's clients; returns when the held
        requests' launch was last checked (None: the thread ends). (A method, so that its list of clients dies with
        each round: kept across the wait, it kept a client nobody references alive, and its intake mailbox with it.)"""
        if not ray.is_initialized():    # this process left the cluster (ray.shutdown()): nothing held will be
            self.failure = self.failure or StageFailed(    # replayed, and any Ray call from here would start a
                f"the deployment {self.dep.placement.name!r} cannot be reached: this process is no longer "
                f"connected to its Ray cluster (ray.shutdown())")        # new local cluster (auto-init)
            for c in list(self.dep._clients):
                c.on_recovery_failed(self.failure)
            self.ready.set()
            return None
        st = self._read()
        clients = list(self.dep._clients)
        # while requests are held or a recovery runs, is the launch still there? (its launcher shut down mid-
        # recovery publishes nothing more, and its teardown deletes the record: nothing else would say so)
        if self.failure is None and (not self.ready.is_set() or any(c._held for c in clients)) and \
                time.monotonic() - checked >= 1.0:
            checked = time.monotonic()
            if self._launch_gone():
                return checked
        if st is None:
            return checked
        if st["generation"] > self.generation:       # a stage failed: hold (replay) what was in flight
            self.generation = st["generation"]
            self.ready.clear()
            err = StageFailed(st["reason"], stage=st["stage"])
            for c in clients:
                c.on_stage_failed(err)
        if st["failure"] and self.failure is None:
            self.failure = StageFailed(st["failure"], stage=st["stage"])
            for c in clients:
                c.on_recovery_failed(self.failure)
            self.ready.set()
        elif st["ready"] and st["recovered"] > self.recovered:
            # the new stages, before anything is resubmitted: a lookup that failed (a slow GCS) is tried again next
            # round; taken for done, the held requests went to the dead intake and stayed held for good
            if not self.dep.refresh_actors():
                return checked
            self.recovered = st["recovered"]
            self.ready.set()
            for c in clients:
                c.on_recovered()
        return checked

    def _launch_gone(self) -> bool:
        """Requests are held for a replay, or a recovery runs: if the launch this handle connected to is gone (its
        launching process shut it down, and with it the recovery record), nothing will replay them or end the
        recovery: they and later calls fail."""
        from .deployment import _named_pg_id
        try:
            if _named_pg_id(self.dep.placement.name) == self.dep._pg_id:
                self._unreachable_since = None
                return False
            why = "was shut down (its placement group is gone)"
        except Exception as e:  # noqa: BLE001 - a passing error is asked again; a cluster gone for good is not
            now = time.monotonic()
            self._unreachable_since = self._unreachable_since or now
            if now - self._unreachable_since < self.UNREACHABLE_S:
                return False
            why = f"cannot be reached ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        self.failure = StageFailed(f"the deployment {self.dep.placement.name!r} {why}: no recovery will replay the "
                                   f"requests it held")
        for c in list(self.dep._clients):
            c.on_recovery_failed(self.failure)
        self.ready.set()
        return True

    def wait_ready(self, timeout: float) -> None:
        """Return once the launcher's supervisor says the deployment serves and its stages serve (health) here; a
        failure it has not detected yet is waited out, as Supervisor.wait_ready does (a stage that does not answer,
        or whose loop ended, is asked again after the record's next read, until the recovery has run or the time
        is up)."""
        def check():
            self.dep._require_up("wait_ready")     # (shut down, or its launch gone: refresh_actors found it)
            self.dep.refresh_actors()
        # (health, as the launcher's: a stage whose loop ended still answers a ping)
        await_ready(self, timeout, check, lambda left: stages_serve(self.dep, left), self.POLL_S)
