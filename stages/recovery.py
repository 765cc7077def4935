"""What a stage runner does when the driver's supervisor recovers the deployment from a failed stage: report its
health, halt (loops stopped, links closed, requests failed, caches reset; weights stay) and open fresh links.
Runs in the stage process, mixed into StageRunner; no Ray.
"""
from __future__ import annotations

import os
import queue
import time

from ..errors import MemraError, StageFailed
from ..scheduler import Event, Scheduler


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where it is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class RecoveryMixin:
    # How long halt() waits for the stage's loop to end (at most; half of timeouts.step_s where that is less, so that
    # the halt answers within the supervisor's wait). A loop still inside a step then would finish it on what the
    # halt makes afresh (the cache, the intake's scheduler, its `lost` mark): the halt fails instead, and the
    # supervisor restarts this stage as it restarts one that cannot halt
    HALT_JOIN_S = 10.0
    # boundary ends a halt closed only halfway (SlotReceiverBase.halt / SlotSenderBase.halt): the supervisor halts
    # every survivor at once, so a neighbour's half may still use what these hold (a peer sender's IPC mapping of
    # our slots, a copy into them queued) until its own halt returns; their close() runs at the next relink (which
    # the supervisor calls only once every halt has returned) or at stop
    _halted: tuple = ()

    def health(self) -> dict:
        """Is this stage's loop (and, on the intake, the ring reader) running; if not, why (the loop's error)."""
        # the intake's loaded adapters ride along: the supervisor reloads them if the intake itself is restarted
        extra = dict(zip(("adapters_seq", "adapters"), self.adapters_seen())) if self.index == 0 else {}
        if self.loop is None:
            return {"index": self.index, "started": False, "alive": True, "error": None, "lost_link": False, **extra}
        return {"index": self.index, "started": True, **self.loop.health(), **extra}

    def halt(self, stage: int, message: str) -> None:
        """Stop serving for a rewire: every request this stage holds ends with a stage-lost error naming `stage`
        (clients replay or fail it), links close (the boundary slots halfway: _close_links), caches reset (decode
        graphs, if on, rebuilt over the new cache, the old ones released first).
        Loaded weights and adapters stay. A loop still inside a step once the wait for it ends (HALT_JOIN_S) fails
        the halt with StageFailed, after this stage's requests have ended: the supervisor restarts the stage."""
        self.here()
        loop = self.loop
        if loop is not None:
            loop.stopping.set()
        for link in (self.sender, self.receiver):   # wake a thread blocked on a credit or a header
            ch = getattr(link, "_ch", None)
            if ch is not None:
                ch.close()
        if self.ring is not None:
            self.ring.close()
        stuck = []
        if loop is not None:
            end = time.monotonic() + min(self.HALT_JOIN_S, self.placement.timeouts.step_s / 2)
            for t in (loop.thread, getattr(loop, "ring_thread", None)):
                if t is not None and t.is_alive():
                    t.join(timeout=max(end - time.monotonic(), 0.0))
                    if t.is_alive():
                        stuck.append(t.name)
        self.loop = None
        self._close_links(halting=True)
        sc = self.placement.scheduler
        if self.spec.intake:
            evs = self.fail_lost(stage, message) + self._fail_pending(message, stage)
            while True:
                try:
                    kind, item = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "req":
                    evs.append(Event(item.client, item.rid, [], [], "error", ("StageFailed", message, stage)))
                elif kind == "post":            # an image request's failure, made before the halt
                    evs.extend(item)
            self.inbox.taken = None             # (every one taken has failed)
            self.mail.post(evs)
        if stuck:
            raise StageFailed(f"stage {self.index}: its thread {', '.join(stuck)} was still inside a step "
                              f"{min(self.HALT_JOIN_S, self.placement.timeouts.step_s / 2):g} s into the halt "
                              f"(the step would end in the fresh cache and scheduler): this stage is restarted too",
                              self.index)
        if self.spec.intake:
            self.scheduler = Scheduler.for_placement(sc, len(self.plan.stages), self.plan.microbatches).carry_counts(
                self.scheduler)
        g = self.model.graphs
        capture = None if g is None else g.capture
        # the old graphs hold the old cache (grown to its budget) and their memory pool: both go before the new
        # cache is made; the new graphs are captured on first use (a halt must end within timeouts.step_s)
        self.kv_growths_past += self.cache.grown
        self.model.graphs = self.cache = g = None
        self.cache = self.model.new_cache(sc.max_batch, sc.max_context)
        if capture is not None:
            self.model.set_decode_graphs(True, self.cache, sc.max_batch, capture=capture)

    def _close_links(self, halting: bool = False) -> None:
        """Close every link, and the boundary ends a halt kept. halting: the boundary ends only halt (the sender
        detaches from the downstream slots; the receiver's channel closes, its slots stay) and are kept."""
        from .slots import SlotReceiverBase, SlotSenderBase
        kept = list(self._halted)
        for x in (self.sender, self.ring, self.receiver, self.ring_listener):
            if x is None:
                continue
            half = halting and isinstance(x, (SlotSenderBase, SlotReceiverBase))
            if half:
                kept.append(x)          # first: a halt that fails still leaves its close() to the relink or stop
            try:
                if half:
                    x.halt()
                else:
                    x.close()
            except (OSError, MemraError, BufferError):
                pass
        self.sender = self.ring = self.receiver = self.ring_listener = None
        self._halted = tuple(kept)
        if not halting:
            self._close_halted()

    def _close_halted(self) -> None:
        """Close the boundary ends earlier halts kept: free the receiver's slots and a sender's exports."""
        kept, self._halted = self._halted, ()
        for x in kept:
            try:
                x.close()
            except (OSError, MemraError, BufferError):
                pass

    def relink(self, run_dir: str, transport: str = "shm") -> dict:
        """Open this stage's receiving side in `run_dir` (at setup, and afresh after a failure, without loading
        anything); returns what the neighbours need to connect."""
        import torch
        from .channel import ChannelListener
        self.here()
        self._close_halted()    # every survivor's halt has returned: no neighbour maps the old slots any more
        from .shm_slots import SlotReceiver
        i, sc = self.index, self.placement.scheduler
        from ..shm import owner_tag
        info = {"index": i, "pid": os.getpid(), "shm_owner": owner_tag(), "endpoint": None, "ring": None,
                "ctx_id": self.engine.ctx,
                "vocab_size": self.mc.text.vocab_size, "eos": list(self.mc.eos_token_ids), "load_s": 0.0}
        if i > 0:
            nbytes = (sc.prefill_chunk + sc.max_batch) * self.mc.text.hidden_size * \
                torch.empty(0, dtype=self.dtype).element_size()
            addr = f"unix:{run_dir}/s{i}.sock"
            if transport == "shm":
                self.receiver = SlotReceiver(f"s{i}", nbytes, addr, spin_us=self.placement.transport_poll_us)
            else:
                from .gpu_slots import RECEIVERS
                self.receiver = RECEIVERS[transport](f"s{i}", nbytes, addr, engine=self.engine,
                                                     spin_us=self.placement.transport_poll_us)
            info["endpoint"] = self.receiver.endpoint()
        if i == 0 and len(self.plan.stages) > 1:
            self.ring_listener = ChannelListener(f"unix:{run_dir}/ring.sock", label="ring")
            info["ring"] = self.ring_listener.address
        if i == 0:   # the intake's publication slots: made on demand, under a prefix its survivors can clean up
            from .pub_inbox import PublicationInbox
            with self._pub_lock:
                if self.pub_inbox is None:
                    self.pub_inbox = PublicationInbox(f"{self.placement.name}_{i}", engine=self.engine)
            info["shm_prefixes"] = [self.pub_inbox.prefix]
        return info
