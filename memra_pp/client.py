"""The Python client: generate / stream / agenerate over a deployment's intake stage (driver side).

One background poller per deployment handle long-polls the intake stage for the events of every client of that
handle (one Ray call per round for all of them, not one per client, nor per token) and routes them to per-request
queues. A lost stage's requests fail or are replayed by client_replay.ReplayMixin.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import numbers
import queue
import threading
import time
import uuid
import weakref
from typing import Iterator

import ray

from .client_replay import ReplayMixin, _Track
from .errors import InputError, MemraError, RequestTimeout, StageFailed
from .placement.schema import MAX_TIMEOUT_S
from .request import REQUEST_DEFAULTS, Result, StreamEvent, _error, _scalar, _token_ids, flag, request_dict
from .supervisor import is_stage_lost

# a longer timeout (inf) waits this long: Python's waits refuse more (threading.TIMEOUT_MAX); the placement's
# timeouts.* are bounded by the same
WAIT_MAX_S = MAX_TIMEOUT_S


_CLOSED = object()      # a stream's queue: closed from another thread

# The poller thread ends once no client has had anything to poll for this long, and the next request starts one: a
# client made per request (dep.client().generate(...)) kept a thread waking 50 times a second until shutdown.
PUMP_IDLE_S = 1.0

log = logging.getLogger("memra_pp.client")
_POLLER_LOCK = threading.Lock()     # makes a deployment handle's poller once


class _Poller:
    """One deployment handle's long-poll loop (a thread while any of its clients has requests): one intake poll a
    round for all its clients, whose ids are "GROUP.CLIENT" (the intake's poll returns every box of the group, so a
    client made while a poll is out is in it). With a pump per client, a server making a client per request had
    the intake answer a poll per client per round (128 streams, a client each: 2.4-2.6x the latency of one shared
    client; benchmarks/many_clients.py)."""

    def __init__(self, dep):
        self.dep = dep
        self.group = uuid.uuid4().hex
        self._lock = threading.Lock()           # taken after a client's locks where both are
        self._clients: dict[str, Client] = {}   # those with a request tracked or held (Client._wake_pump)
        self._all: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # every client: events go to it
        self._thread: threading.Thread | None = None

    def new_id(self, c: "Client") -> str:
        cid = f"{self.group}.{uuid.uuid4().hex}"
        self._all[cid] = c
        return cid

    @staticmethod
    def of(dep) -> "_Poller":
        with _POLLER_LOCK:
            p = getattr(dep, "_poller", None)
            if p is None:
                p = dep._poller = _Poller(dep)
            return p

    def add(self, c: "Client") -> None:
        with self._lock:
            self._clients[c.id] = c
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="memra-client-pump", daemon=True)
                self._thread.start()

    def remove(self, c: "Client") -> None:
        with self._lock:
            self._clients.pop(c.id, None)

    def _ends(self, idle_since: float | None) -> tuple[bool, float | None]:
        """(whether the thread ends now, since when nobody has been polled for): decided under the lock add()
        takes, so a client added later starts a new thread."""
        with self._lock:
            if self._clients:
                return False, None
            now = time.monotonic()
            idle_since = now if idle_since is None else idle_since
            if now - idle_since >= PUMP_IDLE_S:
                self._thread = None
                return True, idle_since
            return False, idle_since

    def _run(self):
        idle_since = None
        while True:
            try:
                with self._lock:
                    clients = list(self._clients.values())
                live = [c for c in clients if c._still_polled()]    # (each leaves the poller once it has nothing)
                ends, idle_since = self._ends(idle_since)
                if ends:
                    return
                if not live:
                    time.sleep(0.02)
                    continue
                self._round(live)
                del clients, live   # (held here, a client let go unclosed would be collected a round late)
            except Exception:  # noqa: BLE001 - a dead poller would leave every later request of the handle unread
                log.exception("memra_pp client poller: a round failed")
                time.sleep(0.2)

    def _round(self, live: list) -> None:
        """One poll for the `live` clients and their events, in a frame of its own: a loop variable left in _run's
        would hold the last client, which a caller let go unclosed, until the next round."""
        if not ray.is_initialized():    # ray.shutdown() in this process: nothing will answer, and a Ray call from
            #                             here would start a new local cluster (Ray's auto-init)
            err = StageFailed("this process is no longer connected to the deployment's Ray cluster (ray.shutdown())")
            for c in live:
                self._each(c, c.on_stage_failed, err)
                self._each(c, c.on_recovery_failed, err)
            time.sleep(0.2)
            return
        intake = self.dep.actors[0]
        try:
            evs = self._poll(intake, live)
        except Exception as e:  # the intake stage is gone or silent: its waiting requests fail (or wait)
            err = StageFailed(f"stage 0 failed: it did not answer a poll: {type(e).__name__}: {e}", stage=0)
            for c in live:
                self._each(c, c.on_stage_failed, err, intake=intake._actor_id)
            self.dep.refresh_actors()       # a connect()ed handle: the restarted stages, by name
            time.sleep(0.2)
            return
        for cid, got in evs.items():       # (a client not polled yet, made while the poll was out, included)
            c = self._all.get(cid)
            if c is not None:
                self._each(c, c._take, got)
        for c in live:
            self._each(c, c._replay_if_recovered)

    @staticmethod
    def _each(c: "Client", fn, *a, **kw) -> None:
        """One client's share of a round; what it raises is logged, and the other clients are served on."""
        try:
            fn(*a, **kw)
        except Exception:  # noqa: BLE001 - one client's failure must not stop the others' events
            log.exception("memra_pp client %s: handling its events failed", c.id)

    def _poll(self, intake, live: list) -> dict:
        """The events of `live` clients from the intake. A poll unanswered for step_s has been queued behind other
        processes' long polls (the intake serves a bounded number at once: 200 clients waiting failed 28 healthy
        requests with step_s 1) unless the intake misses a ping as well (its control calls do not queue behind
        polls): only then is the intake taken for silent (the caller's except)."""
        step = self.dep.placement.timeouts.step_s
        ref = intake.poll.remote(self.group, 0.2)
        while True:
            try:
                return ray.get(ref, timeout=step)
            except ray.exceptions.GetTimeoutError:
                ray.get(intake.ping.remote(), timeout=step)
                for c in live:
                    c.slow_polls += 1
                if self.dep.actors[0] is not intake or all(c._closed.is_set() for c in live):
                    return {}                   # (a replaced intake: poll the new one)


class Stream(Iterator[StreamEvent]):
    """What stream() returns: its events, one next() at a time (readers on several threads each get some of them,
    in turn). close() may come from any thread, also while another thread waits in next() (a generator would
    refuse that: "generator already executing"): that wait then ends as the stream's end, and the request is let
    go as a close on the reading thread lets it go."""

    def __init__(self, pieces, wake):
        self._pieces, self._wake, self._closed = pieces, wake, False
        self._reading = threading.Lock()    # one next() at a time: a second reader waits its turn, each event goes
        #                                     to one of them (a generator refused it: "generator already executing")

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> StreamEvent:
        with self._reading:
            if self._closed:
                # a close() from another thread while this thread was inside next() could not close the pieces
                # ("generator already executing"): the request is let go here, else it ran on to its end
                with contextlib.suppress(ValueError):   # (unless that close is still running the cleanup)
                    self._pieces.close()
                raise StopIteration
            try:
                return next(self._pieces)
            except ValueError:
                if self._closed:        # closed by another thread, whose close is still running the cleanup
                    raise StopIteration from None
                raise

    def close(self) -> None:
        self._closed = True
        self._wake()                # a reader waiting in next() ends; one that comes later stops at the flag
        try:
            self._pieces.close()
        except ValueError as e:     # another thread is inside next(): the wake ends it, and it cleans up
            if "already executing" not in str(e):
                raise


class Client(ReplayMixin):
    def __init__(self, dep):
        self.dep = dep
        self.slow_polls = 0         # polls answered after step_s by a live intake (kept, not taken for a loss)
        self.abandoned = 0          # requests let go because their agenerate's event loop had closed
        self.forget_when_collected = None       # (Deployment.client's weakref.finalize; close() forgets at once)
        self._poller = _Poller.of(dep)             # its deployment handle's (looked up once: each round asks it)
        self.id = self._poller.new_id(self)        # "GROUP.CLIENT": the poller polls the group
        self._tracks: dict[str, _Track] = {}
        self._held: list[_Track] = []          # replay deployments: requests of a lost stage, awaiting recovery
        self._lock = threading.Lock()
        # requests whose reader went away while this client's lock was taken: a stream collected by the cyclic
        # garbage collector runs its cleanup in whatever thread allocated, perhaps inside a `with self._lock`
        # (a Lock does not re-enter); the poller finishes them. SimpleQueue.put is safe there.
        self._dropped: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()
        self._pump_lock = threading.Lock()     # taken before self._lock (and the poller's lock) where both are
        self._polled = False                   # in its deployment handle's poller: a request is tracked or held

    @property
    def _intake(self):
        return self.dep.actors[0]              # a restarted intake is a new actor

    @property
    def _sup(self):
        return getattr(self.dep, "supervisor", None)

    def close(self) -> None:
        """Every request still waiting ends with StageFailed (and is aborted on the intake); the poller lets this
        client go at its next round. The deployment and its intake forget this client (its mailbox, and events still
        on their way to it)."""
        first = not self._closed.is_set()
        self._closed.set()
        with self._lock:
            tracks, self._held = list(self._tracks.values()) + self._held, []
            self._tracks.clear()
        for t in tracks:
            self._abort(t.rid)
            self._deliver(t, ([], [], "error", ("StageFailed", "the client was closed (close(), or its "
                                                               "deployment's shutdown)")))
        if first:
            self.dep._clients.discard(self)
            if self.forget_when_collected is not None:
                self.forget_when_collected.detach()
            try:
                # (an abort's last event that reaches the mailbox after this is dropped there: forget remembers)
                if ray.is_initialized():    # (else the call would start a new local cluster)
                    self._intake.forget_client.remote(self.id)
            except Exception:  # noqa: BLE001 - the intake is gone: so is its mailbox
                pass

    def _abort(self, rid: str) -> None:
        """Tell the intake to drop a request nobody reads any more (fire and forget: it may be gone)."""
        if not ray.is_initialized():    # (ray.shutdown() here: the call would start a new local cluster)
            return
        try:
            self._intake.abort.remote(rid)
        except Exception:  # noqa: BLE001 - a dead intake has nothing left to abort
            pass

    @staticmethod
    def _deliver(t, item) -> bool:
        """Give a request's reader an item; False where that reader is gone: an agenerate whose event loop closed
        (its task never ran its cleanup)."""
        try:
            t.put(item)
        except RuntimeError:
            return False
        return True

    # -- plumbing ---------------------------------------------------------------------------------------------
    def _wake_pump(self) -> None:
        """Have the poller poll this client (called with a request tracked and self._lock free). It leaves the
        poller only while nothing is tracked or held, deciding so under both locks (_still_polled), so a request
        tracked before this call is polled."""
        with self._pump_lock:
            if not self._polled and not self._closed.is_set():
                self._polled = True
                self._poller.add(self)

    def _still_polled(self) -> bool:
        """The poller's question each round: finish dropped requests, then leave the poller if this client has
        nothing tracked or held (or was closed)."""
        self._finish_dropped()
        with self._pump_lock:
            with self._lock:
                if (self._tracks or self._held) and not self._closed.is_set():
                    return True
            if not self._dropped.empty():
                return True
            self._polled = False
            self._poller.remove(self)
            return False

    def _take(self, evs) -> None:
        """A poll's events to their requests. An error naming a lost stage (the intake's own report, usually ahead
        of the supervisor's) holds the request for a replay where the deployment replays."""
        for rid, toks, lps, finish, err in evs:
            with self._lock:
                t = self._tracks.get(rid)
                lost = None
                if t is not None and is_stage_lost(err) and self._replays():
                    if not self._hold_or_give_up(t):     # (the loss is counted either way)
                        del self._tracks[rid]
                        lost = t
                    t = None
                elif t is not None:
                    t.tokens += toks
                    if finish or err:
                        del self._tracks[rid]
            if t is not None:
                if not self._deliver(t, (toks, lps, finish, err)) and not (finish or err):
                    self.abandoned += 1         # nobody reads the rest: let it go, as a cancelled agenerate is
                    self._let_go(t)
            elif lost is not None:
                self._fail(lost, _error(*err))

    def _finish_dropped(self) -> None:
        while True:
            try:
                tr = self._dropped.get_nowait()
            except queue.Empty:
                return
            self._abort(tr.rid)
            self._drop(tr)

    def _let_go(self, tr: _Track) -> None:
        """A request nobody reads any more (a stream closed or dropped, a timeout, a cancelled agenerate): untrack
        it and tell the intake to drop it, now if this client's lock is free, else through the poller."""
        if not self._lock.acquire(blocking=False):
            self._dropped.put(tr)
            return
        try:
            self._untrack(tr)
        finally:
            self._lock.release()
        self._abort(tr.rid)

    def _submit(self, prompt, max_new_tokens, kw: dict, sink=None,
                wait: float | None = None) -> tuple[_Track, queue.Queue, list[int]]:
        """One request with generate's keywords (`kw`); an unknown keyword is refused before anything is sent.
        `wait`: the request's timeout, which also bounds the wait for a recovery in progress (else ready_s)."""
        if self._closed.is_set():   # its deployment was shut down (or it was closed): the actors may be gone
            raise StageFailed("this client was closed (close(), or its deployment's shutdown)")
        if not ray.is_initialized():    # ray.shutdown() since: the submit would start a new local cluster to look in
            raise StageFailed("submit: this process is no longer connected to the Ray cluster of the deployment "
                              "(ray.shutdown() was called); connect() again")
        unknown = sorted(set(kw) - set(REQUEST_DEFAULTS))
        if unknown:
            known = sorted({*REQUEST_DEFAULTS, "max_new_tokens", "logprobs", "timeout"})  # the last three: named
            raise InputError(f"unknown keyword arguments {unknown}; known: {known}")
        ids = self._encode(prompt)
        q: queue.Queue = queue.Queue()
        req = request_dict(kw, raw_image=self._raw_image, client=self.id, prompt=ids, max_new_tokens=max_new_tokens)
        req["job"] = getattr(self.dep, "job", None)     # (the intake aborts it if this driver ends: stages/drivers.py)
        if req.get("images"):       # read now, not once the request has run: its result counts the image rows
            self.dep.model_config   # (_prompt_len), and a connected handle asks the intake for it
        t = self.dep.placement.timeouts
        sup = self._sup
        limit = t.ready_s if wait is None else min(t.ready_s, wait)
        if sup is not None and not sup.ready.wait(limit):   # a recovery is in progress: wait for it
            if sup.failure is None and limit < t.ready_s:   # the request's own timeout: nothing was sent
                raise RequestTimeout(f"the deployment is recovering from a stage failure and was not ready within "
                                     f"{limit:g} s (the request's timeout); nothing was submitted: retry, or wait "
                                     f"with dep.wait_ready()")
            raise sup.failure or StageFailed(f"the deployment did not recover within {t.ready_s:g} s "
                                             f"(timeouts.ready_s); retry once dep.wait_ready() returns")
        if sup is not None and sup.failure is not None:         # a recovery gave up: nothing will serve this
            raise sup.failure
        tr = _Track(uuid.uuid4().hex, req, sink or q.put, gen=sup.generation if sup else 0)
        req["rid"] = tr.rid
        with self._lock:
            if self._closed.is_set():   # closed while this waited for a recovery: not polled, nothing reads
                raise StageFailed("this client was closed (close(), or its deployment's shutdown) while the request "
                                  "waited")
            self._tracks[tr.rid] = tr
        try:
            self._send(tr, req, t.step_s)
            self._wake_pump()   # after the send: a connect()ed handle's send may find a restarted intake to poll
            if self._closed.is_set():   # closed during the send: close() aborted it before the intake had it
                self._abort(tr.rid)
        except StageFailed as e:   # the intake is gone: with replay the request waits for the recovery
            if type(e) is not StageFailed or e.stage is not None or getattr(self.dep, "_gone", None):
                self._drop(tr)
                raise
            with self._lock:
                held = self._replays() and tr.rid in self._tracks and self._hold_or_give_up(tr)
            if held:
                self._wake_pump()       # (it replays the held request once the deployment has recovered)
                return tr, q, ids
            with self._lock:
                self._tracks.pop(tr.rid, None)
            raise self._loss_error(tr, StageFailed(f"stage 0 failed: {e}", stage=0)) from None
        except RequestTimeout as e:     # the intake may take it yet: the abort drops it there (runner.abort)
            self._abort(tr.rid)
            self._drop(tr)
            raise RequestTimeout(f"{e} (timeouts.step_s); request {tr.rid} was aborted") from None
        except BaseException:   # (Ctrl-C in the send, say): the intake may hold it; an abort that overtakes its
            self._abort(tr.rid)     # submit there drops it (runner.abort), so nobody's request runs unread
            self._drop(tr)
            raise
        return tr, q, ids

    def _send(self, tr: _Track, req: dict, step_s: float) -> None:
        """Submit `req` to the intake. A connect()ed handle whose intake the launching process replaced sends it
        once more, to the actor now holding the name: the dead one took nothing. Never to the same actor id: a
        live intake that timed out may hold the request."""
        from .rayutil import get
        intake = self._intake
        tr.intake = intake._actor_id
        ref = self._remote_submit(intake, req)
        try:
            # (a live intake that did not take it in time: _submit aborts it, not a loss; one that raised, or could
            # not read the request, refused it: InputError, not a loss either)
            get(ref, step_s, "submit", timeout_error=RequestTimeout, refused=InputError)
        except StageFailed as e:
            if type(e) is not StageFailed or e.stage is not None or not self.dep.refresh_actors() or \
                    self._intake._actor_id == intake._actor_id:
                if getattr(self.dep, "_gone", None):    # a connect()ed handle whose launch was shut down
                    raise StageFailed(f"submit: {self.dep._gone}") from None
                raise
            tr.intake = self._intake._actor_id
            get(self._remote_submit(self._intake, req), step_s, "submit", refused=InputError)

    @staticmethod
    def _remote_submit(intake, req: dict):
        """intake.submit.remote(req): Ray pickles the request here, and whatever a value of it raises doing so (a
        lock, a file, an object whose own pickling fails) is the request's fault: InputError."""
        try:
            return intake.submit.remote(req)
        except (ray.exceptions.RayError, MemraError):
            raise
        except Exception as e:      # (pickle.PicklingError among them)
            from .rayutil import first_line
            raise InputError(f"the request holds a value that cannot be sent to the intake: {first_line(e)}") \
                from None

    def _drop(self, tr: _Track) -> None:
        with self._lock:
            self._untrack(tr)

    def _untrack(self, tr: _Track) -> None:   # under self._lock
        self._tracks.pop(tr.rid, None)
        if tr in self._held:
            self._held.remove(tr)

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:     # a lone surrogate: the tokenizer would raise its own TypeError
                raise InputError(f"a text prompt must be valid Unicode: {e.reason} at character {e.start} "
                                 f"({prompt[e.start:e.end]!r})") from None
            tok = self.dep.tokenizer
            if tok is None:
                raise InputError("a text prompt needs a tokenizer.json in the model directory; pass token ids")
            # with the tokenizer's own special tokens, as vLLM and llama.cpp encode a prompt (a GGUF's
            # add_bos_token, a tokenizer.json's template: its BOS; a Qwen tokenizer adds none)
            return tok.encode(prompt, add_special_tokens=True)
        ids = _token_ids(prompt)
        if ids is None:
            raise InputError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if isinstance(ids, str):       # int() would turn 5.7 into 5 and True into 1: a wrong prompt, served silently
            raise InputError(f"a prompt's token ids are integers, got {ids}")
        return ids

    def _result(self, toks, lps, finish, logprobs: bool, ids, images=None) -> Result:
        tok = self.dep.tokenizer     # text as vLLM gives it: special tokens (<|im_end|>) skipped, and the stop token
        #                              that ended it left out of the text (kept in the ids)
        return Result(toks, lps if logprobs else None, finish,
                      tok.decode(_shown(toks, finish), skip_special_tokens=True) if tok else None,
                      self._prompt_len(ids, images))

    def _raw_image(self, x):
        """A raw image's rows (a PIL image, an (H, W, 3) array), made as the model's processor makes them."""
        from .model.image import patch_budget, preprocess_image
        from .multimodal import require_tower
        mc = self.dep.model_config
        require_tower(mc)
        return preprocess_image(x, mc.vision, patch_budget(mc), mc.image_pixels)     # (preprocessor_config.json's)

    def _prompt_len(self, ids, images) -> int:
        """The prompt's tokens as the model reads them (vLLM's num_prompt_tokens): a lone image placeholder counts
        its image's rows, as the intake expands it (a prompt written out in full counts the same)."""
        if not images:
            return len(ids)
        from .multimodal import as_image_input, expand_placeholders
        mc = self.dep.model_config
        if mc.vision is None:           # (refused at the intake: no tower)
            return len(ids)
        return len(expand_placeholders(list(ids), [as_image_input(x) for x in images], mc.image_token_id,
                                       mc.vision.spatial_merge_size, mc.video_token_id))

    def _timeout(self, timeout: float | None) -> float:
        """A request's wait for each piece: `timeout` as given (0: what is already there), None: ten steps'
        budget; refused before the request is sent."""
        if timeout is None:
            return self.dep.placement.timeouts.step_s * 10
        timeout = _scalar(timeout)      # a numpy or 0-d torch number: its value
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:
            raise InputError(f"timeout is seconds >= 0 or None, got {timeout!r}")
        return min(float(timeout), WAIT_MAX_S)      # inf (or 1e12): as long as a wait can be

    def _events(self, tr: _Track, q, timeout, primed: bool = False):
        """The request's pieces; closing the generator (or dropping it) before the end frees its sequence. primed:
        first yields None, so that one next() puts it inside its try before the caller reads anything."""
        done = False
        try:
            if primed:
                yield None
            while True:
                try:
                    item = q.get(timeout=timeout)
                except queue.Empty:
                    raise RequestTimeout(f"request {tr.rid} produced nothing for {timeout:g} s") from None
                if item is _CLOSED:         # Stream.close() from another thread: let it go (finally)
                    return
                toks, lps, finish, err = item
                if err is not None:
                    done = True
                    raise _error(*err)
                done = bool(finish)
                yield toks, lps, finish
                if finish:
                    return
        finally:
            if not done:            # the caller stopped reading (or timed out): free the sequence's slot
                self._let_go(tr)
            else:
                self._drop(tr)

    async def _submit_cancellable(self, loop, submit):
        """Run `submit` in the loop's executor. A task cancelled while it runs does not stop it (a thread), so the
        request it submits is let go by whichever side comes last: the thread, if the cancellation came first, or
        the cancellation, if the submit had finished."""
        lk, state = threading.Lock(), {"cancelled": False, "tr": None}

        def run():
            res = submit()
            with lk:
                state["tr"], gone = res[0], state["cancelled"]
            if gone:
                self._let_go(res[0])
            return res
        try:
            return await loop.run_in_executor(None, run)
        except asyncio.CancelledError:
            with lk:
                state["cancelled"], tr = True, state["tr"]
            if tr is not None:
                self._let_go(tr)
            raise

    # -- public -----------------------------------------------------------------------------------------------
    def generate(self, prompt, max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None, logprobs: bool = True,
                 stop_token_ids: list[int] | None = None, ignore_eos: bool = False, adapter: str | None = None,
                 images=None, timeout: float | None = None, **unknown) -> Result:
        """One request to its end. temperature 0 (or under 1e-5) is greedy; top_k 0 (or -1, as vLLM), top_p 1 and
        min_p 0 are off; the filters apply as vLLM's (min_p and top_k, then top_p over what they keep); numbers
        may be numpy or 0-d torch scalars; seed makes a sampled request reproducible whatever it is batched with;
        stop_token_ids end it as the model's eos does, in addition to it (as in vLLM), and with ignore_eos only
        they and max_new_tokens do; the token that stopped it ends r.token_ids but not r.text (as in vLLM), and
        one drawn as the last token max_new_tokens allows ends it as "stop" too (as llama.cpp's server; vLLM v1
        says "length" there and keeps its text);
        adapter names a loaded adapter (dep.load_adapter); images is a list of memra_pp.ImageInput for the
        prompt's image placeholders; timeout bounds the wait for each piece (default 10 x timeouts.step_s).
        logprobs: r.logprobs[i] is token i's log-probability under the raw model (temperature 1)."""
        # `unknown` only collects misspelt keywords, so that _submit refuses them with InputError as stream and
        # agenerate do (a bare TypeError is not a memra_pp error)
        wait, logprobs = self._timeout(timeout), flag("logprobs", logprobs)
        tr, q, ids = self._submit(prompt, max_new_tokens, dict(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, adapter=adapter, images=images, **unknown),
            wait=wait)
        toks, lps, finish = [], [], "length"
        for t, l, f in self._events(tr, q, wait):
            toks += t
            lps += l
            finish = f or finish
        return self._result(toks, lps, finish, logprobs, ids, tr.req.get("images"))

    def stream(self, prompt, max_new_tokens: int = 16, *, logprobs: bool = True, timeout: float | None = None,
               **kw) -> Iterator[StreamEvent]:
        """generate's keywords (keyword-only past max_new_tokens: a third positional argument is generate's
        temperature, never taken for logprobs); each event holds the new token ids, their logprobs and text.
        The request is checked and submitted here, so bad input raises at this call, not at the first next() (what
        only the vision tower can find, rows that are not finite, raises at a next()); an iterator closed (from
        any thread) or dropped before the end frees its sequence."""
        wait, logprobs = self._timeout(timeout), flag("logprobs", logprobs)
        tr, q, _ = self._submit(prompt, max_new_tokens, kw, wait=wait)
        events = self._events(tr, q, wait, primed=True)
        next(events)             # inside its try: from here a close, or the iterator's collection, aborts the request
        tok = self.dep.tokenizer
        dec = tok.incremental_decoder(skip_special_tokens=True) if tok else None   # vLLM: no <|im_end|> in text

        def pieces():
            with contextlib.closing(events):
                yield None       # primed too: a close() before the first next() reaches `events` (Python 3.12+
                #                  does not clear an unstarted generator's frame on close)
                for t, l, f in events:
                    text = None
                    if dec is not None:
                        text = "".join(dec.push(x) for x in _shown(t, f)) + (dec.flush() if f else "")
                    yield StreamEvent(t, l if logprobs else None, text, f)
        it = pieces()
        next(it)
        return Stream(it, lambda: q.put(_CLOSED))

    async def agenerate(self, prompt, max_new_tokens: int = 16, *, logprobs: bool = True,
                        timeout: float | None = None, **kw) -> Result:
        """Same keywords as generate (keyword-only past max_new_tokens, as in stream); any number in flight (no
        thread per request)."""
        wait, logprobs = self._timeout(timeout), flag("logprobs", logprobs)
        loop = asyncio.get_running_loop()
        box = _Box(loop)
        sink = lambda item: loop.call_soon_threadsafe(box.put, item)   # noqa: E731
        tr, _, ids = await self._submit_cancellable(loop, lambda: self._submit(prompt, max_new_tokens, kw, sink, wait))
        toks, lps, finish, done = [], [], "length", False
        try:
            while True:
                t, l, f, err = await box.get(wait, tr.rid)
                if err is not None:
                    done = True
                    raise _error(*err)
                toks += t
                lps += l
                if f:
                    finish, done = f, True
                    break
        finally:
            if not done:                # cancelled or timed out: nobody reads the rest, free its slot
                self._let_go(tr)
            else:
                self._drop(tr)
        return self._result(toks, lps, finish, logprobs, ids, tr.req.get("images"))


def _shown(toks: list[int], finish) -> list[int]:
    """The ids whose text a request shows: all but the stop token that ended it (vLLM's detokenizer leaves it out
    unless include_stop_str_in_output; a non-special one, `</think>` say, would end the text)."""
    return toks[:-1] if finish == "stop" and toks else toks


class _Box:
    """What agenerate's pieces come in by: put on the loop (the poller's call_soon_threadsafe), taken by get.
    A wait parks on a plain future, no task: a loop closed under a waiting agenerate leaves no queue read behind
    that never ran (asyncio.Queue's get as a task did: "coroutine 'Queue.get' was never awaited")."""

    def __init__(self, loop):
        self.loop, self.items, self.waiter = loop, collections.deque(), None

    def put(self, item) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self, wait: float, rid: str):
        """The next item within `wait` seconds, else RequestTimeout; one already here is taken at once (also with
        wait 0). Not asyncio.wait_for: before Python 3.12 it returns and drops a cancellation that arrives as the
        item does (the caller's task then ran the request to its end); asyncio.wait raises it."""
        if not self.items:
            self.waiter = self.loop.create_future()
            try:
                await asyncio.wait({self.waiter}, timeout=wait)
            finally:
                self.waiter = None
            if not self.items:
                raise RequestTimeout(f"request {rid} produced nothing for {wait:g} s")
        return self.items.popleft()
