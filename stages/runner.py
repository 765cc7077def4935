"""The stage runner: everything one stage process does (load its slice, own its boundary slots, run its loop),
importable and testable without Ray. The Ray actor in actor.py is a thin shell over it.
"""
from __future__ import annotations

import collections
import gc
import importlib
import numbers
import os
import queue
import sys
import threading
import time

import torch

from ..errors import ConfigError, InputError, StageFailed
from ..model import attention
from ..model.config import ModelConfig
from ..model.stage_model import StageModel
from ..model.weights import open_weights
from ..placement.planner import Plan
from ..placement.schema import load_placement
from ..overlay import resolve_overlay_publish
from ..scheduler import Event, Request, Scheduler
from ..switches import initial
from ..request import sampling_params
from .drivers import DriversMixin
from .events import Mailboxes, group_of
from .intake_loop import IntakeLoop
from .loops import StageLoop
from .recovery import RecoveryMixin, rss_bytes
from .runner_images import ImagesMixin

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GC_FREEZE = initial("MEMRA_PP_GC_FREEZE")


def stop_ids(stop_token_ids, ignore_eos, eos, vocab: int) -> frozenset[int]:
    """The tokens that end a request: its stop_token_ids and the model's eos, as vLLM (ignore_eos: its stop ids
    alone). A value that is not a token id is refused here, at the intake's submit."""
    try:
        stops = list(stop_token_ids or ())
    except TypeError:
        raise InputError(f"stop_token_ids is a list of token ids, got {stop_token_ids!r}") from None
    if not isinstance(ignore_eos, bool):
        raise InputError(f"ignore_eos must be True or False, got {ignore_eos!r}")
    bad = [t for t in stops if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab]
    if bad:     # (the bad ones: a long list's first eight may all be good)
        raise InputError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad[:8]!r}"
                         + (f" among {len(stops)}" if len(stops) > len(bad) else ""))
    return frozenset(int(t) for t in stops) | (frozenset() if ignore_eos else frozenset(eos))


class _LoadProgress:
    """Weight loading shows progress: a line every 5 s while a stage loads (Ray forwards it to the driver), and one
    when it is done if that took more than a second. On stderr, as every progress line of the stages: Ray copies a
    worker's stdout to the driver's, where a command's --json output must be the JSON alone."""

    def __init__(self, index: int, sp, t0: float):
        self.index, self.sp, self.t0, self.last = index, sp, t0, t0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last >= 5.0 or (done == total and now - self.t0 > 1.0):
            self.last = now
            print(f"stage {self.index} ({self.sp.device}): loaded {done}/{total} layers of "
                  f"[{self.sp.layer_start}, {self.sp.layer_end}) in {now - self.t0:.1f} s", file=sys.stderr, flush=True)


class Inbox(queue.Queue):
    """The intake's inbox: the item a get() took stays `taken` (set under the queue's mutex) until the loop has
    handed it on and clears it, so adapter_users, reading the queue and `taken` under that mutex, never misses a
    request between the inbox and the scheduler (an unload then swapped another adapter in under it)."""

    def _init(self, maxsize):
        super()._init(maxsize)
        self.taken = None

    def _get(self):
        self.taken = item = super()._get()
        return item


class StageRunner(ImagesMixin, RecoveryMixin, DriversMixin):
    # intake: (stage, message) of a stage loss that ended requests here (their clients hold them for a replay) with
    # no recovery since; and when this loop last started after a recovery (see begin_unload)
    lost: tuple[int, str] | None = None
    resumed_at: float | None = None
    fault: str | None = None        # fault injection: the next microbatch computed here raises this (inject_fault)
    _tokenizer = None               # model_info's, read at its first call (False: the model has none)

    def __init__(self):
        self.index = -1
        self.loop = None
        self.receiver = self.sender = self.ring_listener = self.ring = None
        self.gc_frozen = 0          # objects start() froze out of the collector's reach (MEMRA_PP_GC_FREEZE)
        self.mail = Mailboxes()
        self.inbox: Inbox = Inbox()
        self.t_setup = time.monotonic()
        self.tower = None
        self.tower_ctx = None
        self.remote_encode = None       # set by the actor shell when the tower is another stage
        self.pub_inbox = None           # intake: its publication slots (stages/pub_inbox.py), made by relink
        self._pub_lock = threading.Lock()
        self.inbox_writer = None        # tower: the intakes' slots it writes rows into
        self.rx_hashes = None           # battery: sha256 of each received activation while recording
        self.stall_s = 0.0              # fault injection: the next microbatch's compute sleeps this long
        self.kv_rebudgets = 0           # intake: KV budgets given after wiring (adapter loads)
        self.kv_growths_past = 0        # KV pool growths of the caches a halt replaced (kv_growths() adds them)
        self.lora = None                # this stage's LoraPool, made at the first adapter load
        self.token_overlay = None       # intake / primary: the TokenOverlaySet of the loaded adapters
        self.adapter_weights: dict[int, object] = {}
        self.adapter_digests: dict[int, str] = {}     # slot -> what this stage loaded there (content_digest)
        self.switches: dict[str, bool] = {}       # the MEMRA_PP_* modes setup ran with (switches.current)
        # intake: every adapter loading, loaded or unloading, name -> [slot, path, state], whichever handle (launch's
        # or a connect()'s) loads it: the one table that gives out slots and publishes names (the loaded ones are
        # the names clients may use: adapter_names), so no handle overwrites or unloads an adapter another is
        # loading; the supervisor reads its loaded ones every heartbeat, and a detached deployment's intake also
        # keeps them in Ray's KV under _registry_kv at every change (what a restart of this intake reloads)
        self.adapter_registry: dict[str, list] = {}
        self._registry_lock = threading.Condition()     # (a lock, notified when an unloading entry is decided)
        self._registry_kv: bytes | None = None
        self._registry_kv_lock = threading.Lock()   # the KV writes, in snapshot order
        self._registry_seq = self._registry_written = 0     # the last snapshot taken, and written
        self._adapter_lock = threading.Lock()       # this stage's pools: one load or unload at a time
        self._submitting: dict[int, int] = {}       # intake: adapter slot -> submits past its name, not yet queued
        # intake: requests waiting for their images' rows (runner_images: the images thread), the ones of those
        # their clients let go, and the last aborts asked (an abort may overtake its request's submit: Ray runs
        # them on different threads); submit's queueing and abort meet under _pending_lock
        self._pending: dict[str, object] = {}
        self._pending_aborted: set[str] = set()
        self.aborted_early = 0      # aborts of requests the scheduler never had (awaiting images; submit overtaken)
        self._aborts: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._pending_lock = threading.Lock()
        self._images_q: queue.Queue = queue.Queue()
        self._images_thread: threading.Thread | None = None
        self._drivers_init()            # intake: which driver each client group's requests come from (drivers.py)

    def here(self) -> None:
        """Make this stage's context current on the calling thread (Ray calls arrive on pool threads)."""
        if getattr(self, "engine", None) is not None:
            self.engine.make_current()

    # -- boot -------------------------------------------------------------------------------------------------
    def probe_transport(self, src: int, dst: int) -> dict:
        """`transport: auto` for a boundary between two GPUs: a real peer copy, compared at the receiver."""
        from .gpu_slots import probe_p2p
        return probe_p2p(src, dst)

    def setup(self, placement: dict, plan: dict, index: int, run_dir: str, transport: str = "shm",
              switches: dict | None = None) -> dict:
        """Load this stage's slice and open its receiving side (`transport` of its upstream boundary: shm, peer
        or host); returns what the neighbours need to connect. `switches`: the driver's resolved MEMRA_PP_*
        switches, set here before anything is built (None: this process's own, one-process use)."""
        from ..engine import Engine
        from .. import switches as sw
        from ..shm import sweep_dead
        sweep_dead()        # what killed makers left on this host (a SIGKILLed launcher's stages, say)
        if switches is not None:
            sw.apply(switches)
        self.switches = sw.current()
        self.placement, self.plan, self.index = load_placement(placement), Plan.from_dict(plan), index
        sp = self.plan.stages[index]
        self.spec = sp
        torch.set_num_threads(sp.threads)
        try:
            self.engine = Engine(sp.device)
        except ConfigError as e:    # (launch checks devices first only where it starts the cluster on this host)
            raise ConfigError(f"stages[{index}].device: {e}") from None
        if self.engine.is_cuda and not attention.SDPA_CUDNN:
            # for the whole process, not around each call (model/attention.sdpa): the vision tower runs on Ray's
            # pool threads beside the loop thread's prefill, and torch's switch is one flag for the process
            torch.backends.cuda.enable_cudnn_sdp(False)
        if self.engine.is_cuda:     # the chunk mask's module (attention.attend_batch) here, not on the loop thread at
            importlib.import_module("torch.nn.attention.bias")     # the first prompt cut in pieces (1.2 s: dynamo)
        t0 = time.monotonic()
        m = self.placement.model
        self.src = open_weights(m.path, m.format)
        self.mc: ModelConfig = self.src.config
        self.dtype = DTYPES[m.dtype]
        self.model = StageModel(self.mc, sp.layer_start, sp.layer_end, sp.intake, sp.primary).load(
            self.src, self.dtype, sp.device, progress=_LoadProgress(index, sp, t0))
        self.publish_mode = resolve_overlay_publish(self.placement.overlay_publish)
        if sp.tower and self.mc.vision is not None:
            from ..model.vision import VisionTower
            self.tower = VisionTower(self.mc.vision).load(lambda n: self.src.get("visual." + n, self.dtype,
                                                                                  sp.device))
        sc = self.placement.scheduler
        # the weights (and tower) are loaded: the cache's up-front bytes are checked against what the device has left
        # after them (StageCache refuses max_batch x max_context that do not fit with a ConfigError naming both);
        # the graph captures below and the activations come after, with only the check's slack left for them
        self.cache = self.model.new_cache(sc.max_batch, sc.max_context)
        if self.engine.is_cuda:
            self.model.set_decode_graphs(True, self.cache, sc.max_batch)
            t1 = time.monotonic()
            n = self.model.capture_decode_graphs()      # every batch bucket now, not while requests wait
            if n:
                print(f"stage {index} ({sp.device}): {n} decode graphs (batch buckets up to "
                      f"{self.model.graphs.buckets[-1]}) captured in {time.monotonic() - t1:.1f} s",
                      file=sys.stderr, flush=True)
            elif self.model.graphs_failed:
                print(f"stage {index} ({sp.device}): {self.model.graphs_failed}; decoding eagerly", file=sys.stderr,
                      flush=True)
            from ..model import prefill_graphs
            if prefill_graphs.ENABLED:     # a step's rows: a microbatch's prompt tokens and its decode rows
                self.model.set_prefill_graphs(True, sc.prefill_chunk + sc.max_batch)
                t1 = time.monotonic()
                n = self.model.capture_prefill_graphs()
                if n:
                    pg = self.model.pgraphs
                    rules = (f", fla's rule in {len(pg.rules.graphs)} graphs of its own" if pg.rules is not None
                             else f" (fla's rule eager: {pg.rules_failed})" if pg.rules_failed else "")
                    print(f"stage {index} ({sp.device}): prefill graphs for {n} token buckets (up to "
                          f"{pg.buckets[-1]} rows){rules} captured in {time.monotonic() - t1:.1f} s",
                          file=sys.stderr, flush=True)
                elif self.model.pgraphs_failed:
                    print(f"stage {index} ({sp.device}): {self.model.pgraphs_failed}; prompt steps run eagerly",
                          file=sys.stderr, flush=True)
        self.weights_bytes = sum(t.numel() * t.element_size() for t in self.model.tensors())
        self.load_s = time.monotonic() - t0
        info = self.relink(run_dir, transport)
        info.update(ctx=str(self.engine.ctx), load_s=self.load_s, tensors=len(self.src.read_names))
        if sp.intake:
            self.scheduler = Scheduler.for_placement(sc, len(self.plan.stages), self.plan.microbatches)
        return info

    def kv_report(self) -> dict:
        """This stage's KV memory facts, measured once every stage is loaded (Deployment._wire's kv_budget)."""
        self.here()
        return self.cache.kv_report()

    def set_kv_pages(self, pages: int) -> None:
        """The intake: a new KV budget (memory taken after wiring, e.g. the LoRA pools of the first adapter load)."""
        self.scheduler.kv_pages = pages
        self.kv_rebudgets += 1

    def connect(self, downstream: dict | None, ring: str | None, timeout: float, tower_ctx=None,
                kv: tuple[int, int] | None = None) -> None:
        """Connect outgoing links first (a listener's backlog accepts them), then accept the incoming ones.
        `kv` (the intake): (pages, positions per page) every stage can hold, which admissions count against."""
        self.tower_ctx = tower_ctx
        if self.spec.intake and kv is not None:
            self.scheduler.kv_pages, self.scheduler.kv_block = kv
        self.here()
        from .shm_slots import SlotSender
        from ..stages.channel import connect
        if downstream is not None:
            if downstream["transport"] == "shm":
                self.sender = SlotSender(downstream)
            else:
                from .gpu_slots import SENDERS
                self.sender = SENDERS[downstream["transport"]](downstream, engine=self.engine)
            self.sender.connect(timeout)
        if ring is not None:
            self.ring = connect(ring, timeout)
        if self.receiver is not None:
            self.receiver.accept(timeout)
        if self.ring_listener is not None:
            self.ring = self.ring_listener.accept(timeout)

    def start(self, recovered: bool = False) -> None:
        """Start the loop; `recovered`: after a recovery (the supervisor's restart), which ends the stage loss."""
        if recovered:
            self.lost, self.resumed_at = None, time.monotonic()
        if GC_FREEZE:   # (at every start, a recovery's too) what is alive now lives as long as the stage:
            gc.collect()    # a full collection walking it mid-run stalled every stage behind this one (~160 ms on
            gc.freeze()     # the CPU stages measured, set off by a stats() call); vLLM freezes its heap after startup
            self.gc_frozen = gc.get_freeze_count()
        cls = IntakeLoop if self.spec.intake else StageLoop
        self.loop = cls(self)
        self.loop.start()

    # -- requests (intake) ------------------------------------------------------------------------------------
    def submit(self, req: dict) -> None:
        """Validate and queue one request; a bad one raises InputError here and nothing else is touched. An image
        request returns once checked: its tower work runs on the images thread (runner_images)."""
        V = self.mc.text.vocab_size
        prompt = req["prompt"]
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise InputError(f"token ids {bad[:5]} are outside the vocabulary [0, {V})")
        params = sampling_params(req)
        try:   # a value of the wrong type is bad input too, never a crash of the submit call
            stop = stop_ids(req.get("stop_token_ids"), req.get("ignore_eos", False), self.mc.eos_token_ids, V)
            new = req["max_new_tokens"]
            if isinstance(new, bool) or not isinstance(new, int):
                raise InputError(f"max_new_tokens must be an integer >= 0, got {new!r}")
        except InputError:
            raise
        except (TypeError, ValueError) as e:
            raise InputError(f"bad sampling parameters in the request: {type(e).__name__}: {e}") from None
        slot = self._take_adapter(req.get("adapter"))
        try:
            r = Request(req["rid"], req["client"], list(prompt), new, params, stop, adapter=slot,
                        adapter_name=req.get("adapter") if slot >= 0 else None, step0=int(req.get("step0", 0)))
            self.scheduler.validate(r)
            ip = self._plan_images(r, req["images"]) if req.get("images") else None
            if ip is None and self.mc.vision is not None and not r.step0:
                # (a replay's prompt holds the tokens generated before the restart: the model may have made them)
                n = sum(prompt.count(t) for t in {self.mc.image_token_id, self.mc.video_token_id} if t is not None)
                if n:
                    raise InputError(f"the prompt holds {n} image or video placeholder token(s) (ids "
                                     f"{self.mc.image_token_id}, {self.mc.video_token_id}) but no images were given: "
                                     f"pass images=[memra_pp.ImageInput(...)] or drop the placeholders")
            with self._pending_lock:
                if r.rid in self._aborts:       # its client let it go before this submit got here (the abort
                    self.aborted_early += 1     # found nothing in the scheduler: counted here, once)
                    return
                if ip is not None and r.max_new_tokens > 0:
                    self._queue_images(r, ip)
                else:       # (0 new tokens: its images checked, it ends at admission unprefilled: no tower work)
                    self.inbox.put(("req", r))
            self._driver_seen(group_of(r.client), req.get("job"))
        finally:
            if slot >= 0:
                with self._registry_lock:
                    self._submitting[slot] -= 1

    # -- adapters ---------------------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str, slot: int) -> str:
        """Load a PEFT adapter into `slot` on this stage (its own layers' LoRA; token rows on intake/primary);
        the digest of what it read (adapters.content_digest), which every stage's must equal."""
        from ..adapters import load_peft_adapter, token_overlay_set
        from ..model.lora import LoraPool
        self.here()
        ad = self.placement.adapters
        aw = load_peft_adapter(path, self.mc, ad.max_rank, name=name)
        sp = self.spec
        with self._adapter_lock:        # (Ray runs actor calls on several threads: two handles may load at once)
            if self.lora is None:
                self.lora = LoraPool(self.mc, range(sp.layer_start, sp.layer_end), ad.max_loras, ad.max_rank,
                                     self.dtype, sp.device)
            self.lora.load(slot, aw.for_layers(sp.layer_start, sp.layer_end))
            if sp.intake or sp.primary:
                self.adapter_weights[slot] = aw
                self.token_overlay = token_overlay_set(self.engine, self.adapter_weights, ad.max_loras, self.mc.tied)
            self.adapter_digests[slot] = aw.digest
        return aw.digest

    def adapter_digest(self, slot: int) -> str | None:
        """The digest of the adapter this stage holds in `slot` (None: none): a restart's reload is checked
        against a surviving stage's."""
        with self._adapter_lock:
            return self.adapter_digests.get(slot)

    def unload_adapter(self, slot: int) -> None:
        from ..adapters import token_overlay_set
        self.here()
        with self._adapter_lock:
            self.adapter_digests.pop(slot, None)
            if self.lora is not None:
                self.lora.unload(slot)
            if self.adapter_weights.pop(slot, None) is not None:
                self.token_overlay = token_overlay_set(self.engine, self.adapter_weights,
                                                       self.placement.adapters.max_loras, self.mc.tied)

    # the intake's registry (stages/runner.adapter_registry): reserve -> (every stage loads) -> commit publishes the
    # name; begin_unload withdraws it -> (every stage unloads) -> release, or abort_unload publishes it again
    def reserve_adapter(self, name: str, path: str, slot: int | None = None) -> int:
        """Intake: take the lowest free adapter slot for `name` (or `slot`, a restart's reload), refusing a name
        already known or a full pool; the slot is the caller's (loading) until commit_adapter or release_adapter."""
        with self._registry_lock:
            reg, cap = self.adapter_registry, self.placement.adapters.max_loras
            if name in reg:
                raise InputError(f"adapter {name!r} is already {reg[name][2]} (slot {reg[name][0]}); unload it "
                                 f"first" if reg[name][2] == "loaded" else
                                 f"adapter {name!r} is being {reg[name][2][:-3]}ed by another handle (slot "
                                 f"{reg[name][0]}); try again when that finishes")
            used = {e[0] for e in reg.values()}
            if slot is not None and not 0 <= slot < cap:
                raise InputError(f"adapter slot {slot} is outside adapters.max_loras ({cap})")
            free = [k for k in range(cap) if k not in used] if slot is None else [slot]
            if not free or free[0] in used:
                raise InputError(f"the adapter pool is full ({cap} slots: {sorted(reg)}); unload one or raise "
                                 f"adapters.max_loras")
            reg[name] = [free[0], path, "loading"]
            return free[0]

    def commit_adapter(self, name: str, slot: int) -> None:
        """Intake: every stage holds `name` in `slot`: it is loaded, and clients may select it by name."""
        with self._registry_lock:
            e = self.adapter_registry.get(name)
            if e is None or e[0] != slot or e[2] != "loading":
                raise InputError(f"adapter {name!r} is not being loaded into slot {slot} (registry: {e}); it was "
                                 f"unloaded or replaced meanwhile")
            e[2] = "loaded"
        self._keep_registry()

    def fail_lost(self, stage: int, message: str) -> list[Event]:
        """Intake: stage `stage` is lost. Every request in the scheduler ends with StageFailed (the events), and
        the loss is recorded in `lost` until a recovery starts this stage again (begin_unload refuses meanwhile)."""
        self.lost = (stage, message)
        return self.scheduler.fail_all("StageFailed", message, stage)

    # After a recovery, the requests it cut come back as replays: the launching handle's at once, a connect()ed
    # handle's at its next read of the recovery record (RemoteSupervisor.POLL_S, 0.2 s). An unload waits this long
    # after the recovery for them, so that they are counted as the adapter's users.
    REPLAY_GRACE_S = 1.0

    def begin_unload(self, name: str) -> int:
        """Intake: withdraw a loaded adapter's name (no new request selects it) and mark it unloading; its slot.
        With `recover: replay`, requests held by their clients for a replay still use their adapter: while a stage
        loss has ended requests here and no recovery has run, the unload is refused (StageFailed; adapter_users
        refuses too, for a loss after this), and just after a recovery it waits up to REPLAY_GRACE_S for the
        replays (a held request's adapter was unloaded under it: its replay was refused)."""
        self._refuse_unload_while_lost(repr(name))
        if self.resumed_at is not None and self.placement.recover == "replay":
            while (left := self._grace_left()) > 0:    # (again, should another recovery come during the wait)
                time.sleep(left)
            self._refuse_unload_while_lost(repr(name))      # (a stage lost during the wait)
        with self._registry_lock:
            e = self.adapter_registry.get(name)
            if e is None:
                raise InputError(f"unknown adapter {name!r}; loaded: {sorted(self._published())}")
            if e[2] != "loaded":
                raise InputError(f"adapter {name!r} is being {e[2][:-3]}ed by another handle; try again when that "
                                 f"finishes")
            e[2] = "unloading"
            slot = e[0]
        self._keep_registry()
        return slot

    def _refuse_unload_while_lost(self, what: str, counting: bool = False) -> None:
        """recover: replay: StageFailed while a stage loss has ended requests here that no recovery has replayed;
        `counting` (adapter_users): also for REPLAY_GRACE_S after a recovery (one that ran after begin_unload's
        wait: its replays may not be here to be counted yet)."""
        if self.lost is not None:
            if self.placement.recover == "replay":
                raise StageFailed(f"adapter {what} cannot be unloaded now: {self.lost[1]}, and the deployment has not "
                                  f"recovered yet (requests held for a replay may still use it); retry once "
                                  f"dep.wait_ready() returns", stage=self.lost[0])
        elif counting and self._grace_left() > 0 and self.placement.recover == "replay":
            raise StageFailed(f"adapter {what} cannot be unloaded now: the deployment recovered from a stage loss "
                              f"while it was being unloaded, and the requests that loss cut are being replayed (they "
                              f"may still use it); retry the unload")

    def _grace_left(self) -> float:
        """Seconds of REPLAY_GRACE_S left after the last recovery's start (0: none, or its replays are in)."""
        return 0.0 if self.resumed_at is None else max(0.0, self.resumed_at + self.REPLAY_GRACE_S - time.monotonic())

    def abort_unload(self, name: str) -> None:
        """Intake: an unload that did not happen (requests still use the adapter): loaded and published again."""
        with self._registry_lock:
            e = self.adapter_registry.get(name)
            if e is None or e[2] != "unloading":
                return
            e[2] = "loaded"
            self._registry_lock.notify_all()
        self._keep_registry()

    def release_adapter(self, name: str) -> None:
        """Intake: give `name`'s slot back (an unload, or a load that failed) and withdraw its name."""
        with self._registry_lock:
            self.adapter_registry.pop(name, None)
            self._registry_lock.notify_all()
        self._keep_registry()

    def registry_key(self, key: bytes | None) -> None:
        """Intake of a detached deployment: keep the loaded adapters, name -> [slot, path], as JSON under `key` in
        Ray's KV, now and at every change. If this intake dies, the supervisor reloads them from there: its
        heartbeat alone would miss what a connect()ed handle loaded or unloaded since the last beat."""
        with self._registry_lock:
            self._registry_kv = key
        self._keep_registry()

    def _keep_registry(self) -> None:
        """The loaded adapters into Ray's KV, where registry_key asked for it: a snapshot taken under the registry's
        lock, written outside it (a slow write must not hold up the heartbeat, which reads the registry), newest
        snapshot last. Where a write fails, the key is deleted, so that the supervisor falls back to what its
        last heartbeat read rather than to an older list; both failures are logged."""
        import json
        import logging
        from ray.experimental import internal_kv
        with self._registry_lock:
            # (every change has a number, kept in Ray's KV or not: adapters_seen's version)
            self._registry_seq = seq = self._registry_seq + 1
            key = self._registry_kv
            if key is None:
                return
            raw = json.dumps(self._loaded())
        with self._registry_kv_lock:
            if seq < self._registry_written:     # a newer snapshot is already there
                return
            self._registry_written = seq
            try:
                internal_kv._internal_kv_put(key, raw.encode())
            except Exception:  # noqa: BLE001 - the registry itself is intact; only the restart's copy is not
                logging.getLogger("memra_pp").exception("could not keep the adapter registry in Ray's KV")
                try:
                    internal_kv._internal_kv_del(key)
                except Exception:  # noqa: BLE001
                    logging.getLogger("memra_pp").exception("could not delete the stale adapter registry either")

    def adapters(self, loaded_only: bool = False) -> dict[str, tuple]:
        """Intake: the registry, name -> (slot, path, state); `loaded_only`: name -> (slot, path) of the loaded."""
        with self._registry_lock:
            if loaded_only:
                return self._loaded()
            return {n: tuple(e) for n, e in self.adapter_registry.items()}

    def _loaded(self) -> dict[str, tuple]:
        """(under _registry_lock) The loaded adapters, name -> (slot, path)."""
        return {n: (e[0], e[1]) for n, e in self.adapter_registry.items() if e[2] == "loaded"}

    def adapters_seen(self) -> tuple[int, dict[str, tuple]]:
        """Intake: (the registry's version, its loaded adapters name -> (slot, path)), read together. A handle keeps
        the newest it has seen: a heartbeat's answer read before a load's commit, arriving after the load's own read,
        overwrote it, and a restart of the intake then reloaded the adapters without that one."""
        with self._registry_lock:
            return self._registry_seq, self._loaded()

    def check_adapter(self, r: Request) -> None:
        """Intake, as the loop takes a request: its adapter must still be in the slot submit found it in. A request
        queued while a recovery ran (the loop stopped) could outlive its adapter, one whose reload after the restart
        failed and was dropped (supervisor): it then ran with an empty slot, failing its whole microbatch, or with
        the next adapter loaded into that slot. InputError (this request alone) where it did."""
        if r.adapter < 0:
            return
        with self._registry_lock:
            e = self.adapter_registry.get(r.adapter_name)
            if e is not None and e[0] == r.adapter and e[2] in ("loaded", "unloading"):
                return
        raise InputError(f"adapter {r.adapter_name!r} is no longer loaded in slot {r.adapter} (unloaded, or dropped "
                         f"when its reload after a stage restart failed): this request did not run; load it again "
                         f"and retry")

    def _published(self) -> dict[str, int]:
        return {n: e[0] for n, e in self.adapter_registry.items() if e[2] == "loaded"}

    @property
    def adapter_names(self) -> dict[str, int]:
        """Intake: the names clients may select an adapter by -> its slot (the registry's loaded adapters)."""
        with self._registry_lock:
            return self._published()

    def adapter_users(self, slot: int) -> int:
        """Intake: requests with this adapter slot being submitted, waiting for their images, submitted (still in
        the inbox), waiting or running (read from an actor thread: a snapshot, taken in the order a request goes
        through them, so that one moving on meanwhile is still counted)."""
        sch = self.scheduler
        with self._registry_lock:
            n = self._submitting.get(slot, 0)
        with self._pending_lock:
            n += sum(r.adapter == slot for r in self._pending.values())
        with self.inbox.mutex:      # (the one the loop has taken and not yet added: Inbox.taken)
            queued = [item[1] for item in [*self.inbox.queue, self.inbox.taken] if item and item[0] == "req"]
        with sch.mu:
            waiting, active = list(sch.waiting), list(sch.active.values())
        # a stage lost since begin_unload ended requests that their clients hold for a replay, uncounted here: the
        # unload is refused (after the snapshot: fail_lost marks the loss before it empties the scheduler)
        self._refuse_unload_while_lost(f"in slot {slot}", counting=True)
        return n + sum(r.adapter == slot for r in queued) + sum(r.adapter == slot for r in waiting) + \
            sum(q.req.adapter == slot for q in active)

    def _take_adapter(self, name: str | None) -> int:
        """The slot of the loaded adapter `name` (-1: none), counted as being submitted until submit has queued
        the request (an unload meanwhile sees it: adapter_users)."""
        if name is None:
            return -1
        if not isinstance(name, str):
            raise InputError(f"adapter must be a loaded adapter's name (a string) or None, got {name!r}")
        with self._registry_lock:
            e, until = self.adapter_registry.get(name), time.monotonic() + self.UNLOAD_DECIDED_S
            # an unload withdraws the name before it counts the users, and is refused if there are any: a request
            # in between waits for the decision (milliseconds), not refused for an adapter that stays loaded
            while e is not None and e[2] == "unloading" and (left := until - time.monotonic()) > 0:
                self._registry_lock.wait(left)
                e = self.adapter_registry.get(name)
            if e is None or e[2] != "loaded":
                raise InputError(f"unknown adapter {name!r}; loaded: {sorted(self._published())}")
            self._submitting[e[0]] = self._submitting.get(e[0], 0) + 1
            return e[0]

    UNLOAD_DECIDED_S = 2.0      # the longest a request waits for an unload of its adapter to be done or refused

    ABORTS_KEPT = 4096      # the last aborts remembered for a submit they overtook

    def abort(self, rid: str) -> None:
        with self._pending_lock:
            if rid in self._pending:           # its images are being made: the images thread drops it
                if rid not in self._pending_aborted:
                    self._pending_aborted.add(rid)
                    self.aborted_early += 1
                return
            self._aborts[rid] = None
            if len(self._aborts) > self.ABORTS_KEPT:
                self._aborts.popitem(last=False)
            self.inbox.put(("abort", rid))

    def poll(self, group: str, timeout: float) -> dict[str, list[tuple]]:
        self._driver_seen(group)
        return self.mail.poll(group, timeout)

    def forget_client(self, client: str) -> None:
        self.mail.forget(client)

    # -- operators --------------------------------------------------------------------------------------------
    def model_info(self) -> dict:
        """What a connected handle needs of the model (Deployment._remote_model): its config and its tokenizer,
        read here, where the model directory is (the handle's host may not have it, or another checkpoint there)."""
        from ..model.tokenizer import Tokenizer
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.for_model(self.placement.model.path, self.placement.model.format) or False
        return {"config": self.mc, "tokenizer": self._tokenizer or None}

    def describe(self) -> dict:
        """What a client attaching by name needs: the placement, the plan and the model's vocabulary facts."""
        return {"placement": self.placement.to_dict(), "plan": self.plan.to_dict(),
                "vocab_size": self.mc.text.vocab_size, "eos": list(self.mc.eos_token_ids)}

    def stats(self, reset: bool = False, timeline: bool = False) -> dict:
        st = {"index": self.index, "device": self.spec.device, "layers": [self.spec.layer_start,
              self.spec.layer_end], "ctx": str(self.engine.ctx), "load_s": self.load_s}
        st.update(self.loop.stats(reset, timeline) if self.loop else   # no loop: recovering
                  {"busy": 0.0, "microbatches": 0, **({"timeline": []} if timeline else {})})
        link = self.receiver or self.sender
        ls = link.stats(reset) if link is not None else {}
        st["transport"] = getattr(link, "TRANSPORT", None)
        st["gdn_backend"] = self.model.gdn_backend
        st["switches"] = dict(self.switches)      # the MEMRA_PP_* modes this stage was set up with
        g = self.model.graphs
        st["decode_graphs"] = g.stats() if g is not None else {"off": self.model.graphs_failed or "eager"}
        g = self.model.pgraphs
        st["prefill_graphs"] = g.stats() if g is not None else {"off": self.model.pgraphs_failed or "eager"}
        st["weights_bytes"] = self.weights_bytes
        st["gc_frozen"] = self.gc_frozen
        st["cache_bytes"] = self.cache.nbytes()
        if self.engine.is_cuda:
            st["device_allocated_bytes"] = torch.cuda.memory_allocated(self.engine.device.index)
            # KV pools grown in place are mapped by the driver, outside torch's allocator (and its figure above)
            st["kv_mapped_bytes"] = self.cache.mapped_bytes()
        st["handoffs"] = ls.get("handoffs", 0)
        st["handoff_p50_us"] = ls.get("handoff_p50_us") or 0.0     # None: no handoff yet (in this window)
        st["handoff_p99_us"] = ls.get("handoff_p99_us") or 0.0
        st["mailbox_headers"] = ls.get("mailbox_headers", 0)
        snd = ls if link is self.sender else self.sender.stats(reset) if self.sender is not None else {}
        if "write_us_mean" in snd:      # where this stage's sends go: the data path, and the header's path
            st["send_write_us"], st["send_header_us"] = snd["write_us_mean"], snd["header_us_mean"]
        if "socket_headers" in snd:     # headers this stage sent: into the receiver's mailbox, and over the socket
            st["send_mailbox_headers"], st["send_socket_headers"] = snd["mailbox_headers"], snd["socket_headers"]
        st["kv_pages_free"] = len(self.cache.free_blocks)
        # by this stage's sequences: live ones, and those finished since the last microbatch, whose pages go back
        # with the next one (Scheduler._finish; admission counts them free already: kv_pages_reserved)
        st["kv_pages_held"] = sum(map(len, self.cache.owned))
        # KV pool growths, and how they grow: "in place" (the decode graphs stay) or why they copy
        st["kv_growths"], st["kv_growth"] = self.kv_growths(), self.cache.copy_growth or "in place"
        if self.spec.intake:
            sc = self.scheduler
            st.update(kv_pages=sc.kv_pages, kv_pages_reserved=sc.kv_used, kv_admission_waits=sc.kv_waits,
                      kv_rebudgets=self.kv_rebudgets)
        st["overlay_publications"] = self.engine.counters.publications
        st["publications_via_slot"] = self.pub_inbox.landed if self.pub_inbox is not None else 0
        st["splices"] = self.engine.counters.splices
        st["mid_span_splices"] = self.engine.counters.mid_span_splices
        st["rss_bytes"] = rss_bytes()
        return st

    def kv_growths(self) -> int:
        """KV pool growths since load, across halts (each halt makes a fresh cache that counts from zero): a timed
        window's figure is a difference of two of these, which a halt inside it would otherwise make negative."""
        return self.kv_growths_past + self.cache.grown

    def inject_stall(self, seconds: float) -> None:
        """Fault injection for operators and tests: the next microbatch computed here hangs `seconds` (the actor
        keeps answering heartbeats), which the supervisor must detect as a stuck stage."""
        self.stall_s = float(seconds)

    def inject_fault(self, message: str) -> None:
        """Fault injection for operators and tests: the next microbatch computed here raises RuntimeError(message)
        (that microbatch's requests fail; the stage and every other request go on)."""
        self.fault = str(message)

    def ping(self) -> int:
        return self.index

    def pid(self) -> int:
        """This stage's process (a launch that fails unlinks what a stage it killed mid-setup made: its segments'
        names carry the pid)."""
        return os.getpid()

    def stop(self) -> None:
        self.here()
        self._stop_reaper()
        self._stop_images()
        if self.loop:
            self.loop.stop()
        self._close_links()
        if self.pub_inbox is not None:
            self.pub_inbox.close()
        if getattr(self, "inbox_writer", None) is not None:
            self.inbox_writer.close()
