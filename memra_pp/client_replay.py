"""What a client does when a stage is lost (driver side): every request in flight fails with the loss, or, with
`recover: replay`, waits for the recovery and is resubmitted from its token history. Called by the deployment handle's
client poller and by its supervisor thread; a mixin of client.Client, whose state (tracks, lock) it shares."""
from __future__ import annotations

import dataclasses
import uuid

from .errors import InputError, MemraError, RequestTimeout, StageFailed
from .rayutil import get


@dataclasses.dataclass(eq=False)
class _Track:
    """One request as the client knows it: what was asked and every token delivered so far (its replay history,
    kept here so that it survives the loss of the intake stage)."""
    rid: str
    req: dict
    put: object
    tokens: list = dataclasses.field(default_factory=list)
    gen: int = 0                  # the supervisor generation the request was (re)submitted in
    intake: object = None         # the actor id of the intake it was (re)submitted to
    losses: int = 0               # stage losses it was in flight at with no token delivered in between
    tokens_at_loss: int = -1      # its tokens at the last of them


# A request lost this many times in a row with no token delivered in between is failed, not replayed again: one that
# breaks a stage every time it runs would otherwise restart the deployment forever (every other request waiting).
MAX_REPLAYS = 3


class ReplayMixin:
    """Client's stage-failure side: holds a lost stage's requests (replay) or fails them, and resubmits the held
    ones once the supervisor has recovered. Uses the client's _tracks, _held, _lock, _intake, _sup, _deliver,
    _abort and dep."""

    def _replays(self) -> bool:
        return self.dep.placement.recover == "replay" and self._sup is not None

    def on_stage_failed(self, e: StageFailed, intake=None) -> None:
        """A stage was lost: every request in flight (or, given `intake`, an actor id, those submitted to that
        intake: a request already on its replacement goes on) fails with `e`, or, with recover: replay, waits for
        the recovery and is replayed from its token history; unless this is its (MAX_REPLAYS + 1)th loss in a row
        with no token delivered in between: then it fails, saying so."""
        with self._lock:
            tracks = [t for t in self._tracks.values() if intake is None or t.intake in (None, intake)]
            rids = [t.rid for t in tracks]      # (a replay goes under a new rid)
            if self._replays():
                tracks = [t for t in tracks if not self._hold_or_give_up(t)]
            for t in tracks:
                self._tracks.pop(t.rid, None)
        if intake is None:      # the intake may have survived the loss and have a submit still to take: one that
            for rid in rids:    # reached it after the halt ran to its budget, unread, beside its own replay
                self._abort(rid)
        for t in tracks:
            self._fail(t, e)

    def _hold_or_give_up(self, t: _Track) -> bool:
        """(under self._lock; recover: replay) A request of a lost stage, reported by the supervisor or by the
        intake's own error event: held for the replay (True), unless this is its (MAX_REPLAYS + 1)th loss in a row
        with no token delivered in between, or the recovery has already failed (the launch is gone): then the caller
        fails it (False)."""
        t.losses = t.losses + 1 if len(t.tokens) == t.tokens_at_loss else 1
        t.tokens_at_loss = len(t.tokens)
        sup = self._sup
        if t.losses > MAX_REPLAYS or (sup is not None and sup.failure is not None):
            return False
        self._hold(t)
        return True

    def _loss_error(self, t: _Track, e: StageFailed) -> StageFailed:
        """What a request of a lost stage that is not held ends with: `e`, or the replay cap's, or the failed
        recovery's."""
        sup = self._sup
        if t.losses > MAX_REPLAYS:
            return StageFailed(f"{e}; this request was in flight at {t.losses} stage failures in a row without a "
                               f"token between them and is not replayed again (a request that breaks a stage each "
                               f"time would restart it forever)", stage=e.stage)
        if t.losses and sup is not None and sup.failure is not None:
            return sup.failure
        return e

    def _fail(self, t: _Track, e: StageFailed) -> None:
        """End a request of a lost stage (_loss_error says with what)."""
        e = self._loss_error(t, e)
        self._deliver(t, ([], [], "error", (type(e).__name__, str(e), e.stage)))

    def on_recovery_failed(self, e: StageFailed) -> None:
        with self._lock:
            held, self._held = self._held, []
        for t in held:          # (_deliver: one agenerate whose loop has closed must not stop the others' errors)
            self._deliver(t, ([], [], "error", (type(e).__name__, str(e), e.stage)))

    def on_recovered(self) -> None:
        self._replay_if_recovered(force=True)

    def _hold(self, t: _Track) -> None:   # under self._lock
        self._tracks.pop(t.rid, None)
        self._held.append(t)

    def _replay_if_recovered(self, force: bool = False) -> None:
        """Resubmit held requests whose failure a completed recovery has dealt with: prompt + delivered tokens,
        the remaining budget, and the sampling step to continue from (seeded draws stay (seed, step))."""
        sup = self._sup
        if sup is None or not self._held or not sup.ready.is_set():
            return
        with self._lock:
            go = [t for t in self._held if force or t.gen < sup.recovered]
            self._held = [t for t in self._held if t not in go]
            gen, intake = sup.generation, self._intake
            for t in go:
                t.rid, t.gen, t.intake = uuid.uuid4().hex, gen, intake._actor_id
                self._tracks[t.rid] = t
        refs = []
        for t in go:
            done = len(t.tokens)
            req = dict(t.req, rid=t.rid, prompt=t.req["prompt"] + t.tokens,
                       max_new_tokens=t.req["max_new_tokens"] - done, step0=done)
            refs.append(intake.submit.remote(req))
        if not refs:
            return
        # each on its own: the new intake refusing one (its adapter could not be reloaded: "unknown adapter") ends
        # that one with the refusal. One failure for all held every request of the client again, for a recovery
        # that never came: they hung to their timeout (for ever with timeout=inf)
        lost, step, slow = None, self.dep.placement.timeouts.step_s, set()
        try:
            get(refs, step, "replay")
        except MemraError:
            for t, ref in zip(go, refs):    # (all answered or waited out by now: each one's own outcome)
                try:
                    get(ref, 0, "replay", timeout_error=RequestTimeout, refused=InputError)
                except RequestTimeout:      # a live intake that did not take it in time, as a submit's (Client.
                    #                         _submit): aborted there, this request ends; no stage was lost (taken
                    #                         for one, every request of the client on that intake was held for a
                    #                         recovery that never came, the healthy ones too)
                    self._abort(t.rid)
                    slow.add(t.rid)
                    with self._lock:
                        known = self._tracks.pop(t.rid, None) is not None
                    if known:
                        msg = (f"the request was replayed after a stage failure and the intake did not take it within "
                               f"{step:g} s (timeouts.step_s); request {t.rid} was aborted")
                        self._deliver(t, ([], [], "error", ("RequestTimeout", msg, None)))
                except StageFailed as e:    # the new intake gone or silent: a stage failure (held or failed below)
                    lost = e
                except MemraError as e:     # refused by the intake: this request ends, typed
                    with self._lock:
                        known = self._tracks.pop(t.rid, None) is not None
                    if known:
                        msg = f"the request was replayed after a stage failure and the new intake refused it: {e}"
                        self._deliver(t, ([], [], "error", (type(e).__name__, msg, None)))
        if lost is not None:    # (those submitted to this intake, the replayed ones among them)
            self.on_stage_failed(StageFailed(f"stage 0 failed: replay was not accepted: {lost}", stage=0),
                                 intake=intake._actor_id)
            return
        with self._lock:         # a reader gone between the new rid and the submit: its abort went first
            gone = [t.rid for t in go if t.rid not in self._tracks and t.rid not in slow]
        for rid in gone:         # (a request that already finished is no longer in the scheduler: a no-op)
            self._abort(rid)
