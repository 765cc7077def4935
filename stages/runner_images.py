"""The image side of a stage runner: a request's images become rows resident in the intake engine, computed there
when the tower is the intake stage, else by the tower stage and published by host bounce into the intake's
publication slots. Mixed into stages/runner.py's StageRunner; runs in the stage process.
"""
from __future__ import annotations

import dataclasses
import threading

import torch

from ..errors import InputError, MemraError, StageFailed
from ..model.image import patch_budget
from ..multimodal import plan_images
from ..overlay import EmbedOverlay, must_publish, publish_out
from ..scheduler import Event, Request


class ImagesMixin:
    """An image request's submit checks it (plan_images, the scheduler's bounds, a tower to run it) and returns;
    the tower's work runs on this stage's images thread, one request at a time (a tower pass holds activations
    for every patch: two at once could run the device out of memory, and on a CPU they would share its cores),
    never on the actor's call threads, which answer the supervisor's heartbeats and the clients' polls. The
    request waits there as pending (an abort or an adapter unload sees it) until its rows are resident, then
    goes to the inbox as a text request does; a failure there reaches its client as an error event."""

    def _plan_images(self, r: Request, images):
        """Everything an image request can be refused for before the tower runs: raises InputError."""
        try:
            ip = plan_images(r.prompt, images, self.mc, patch_budget(self.mc), generated=r.step0)
        except (TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
            if isinstance(e, MemraError):
                raise
            raise InputError(f"malformed images: {type(e).__name__}: {e}") from None
        self.scheduler.validate(dataclasses.replace(r, prompt=ip.prompt))
        if self.tower is None:
            if self.remote_encode is None:
                raise InputError("this deployment has no vision tower engine (the model has no vision_config)")
            must_publish(self.publish_mode, self.tower_ctx, self.engine.ctx)   # NEVER refuses before any work
        return ip

    def _queue_images(self, r: Request, ip) -> None:
        """Under _pending_lock (submit's): r waits as pending for the images thread."""
        if self._images_thread is None:
            self._images_thread = threading.Thread(target=self._images_loop, name=f"stage{self.index}-images",
                                                   daemon=True)
            self._images_thread.start()
        self._pending[r.rid] = r
        self._images_q.put((r, ip))

    def _images_loop(self) -> None:
        while (item := self._images_q.get()) is not None:
            r, ip = item
            err = None
            if r.rid not in self._pending_aborted and self._pending.get(r.rid) is r:    # (not let go, not halted)
                try:
                    self._attach_images(r, ip)
                except MemraError as e:
                    err = e
                except Exception as e:      # never the thread's end: the next request's images still run
                    err = StageFailed(f"stage {self.index}: images: {type(e).__name__}: {e}")
            with self._pending_lock:
                if r.rid in self._pending_aborted or self._pending.get(r.rid) is not r:
                    # its client let it go, or a halt failed it (the stage restarted under it): nobody reads it
                    self._pending_aborted.discard(r.rid)
                elif err is not None:
                    if isinstance(err, StageFailed) and err.stage is not None:     # the tower's stage is lost:
                        self.lost = (err.stage, str(err))       # its client holds r for a replay (begin_unload)
                    self.inbox.put(("post", self.scheduler.fail_one(r, err)))
                else:
                    self.inbox.put(("req", r))
                if self._pending.get(r.rid) is r:
                    del self._pending[r.rid]            # (after the put: adapter_users always sees it)

    def _fail_pending(self, message: str, stage: int | None) -> list:
        """A halt: the requests waiting for their images end with the stage's failure (their clients hold or fail
        them as they do the scheduler's); their tower work, running or queued, lands nowhere."""
        with self._pending_lock:
            failed, self._pending = list(self._pending.values()), {}
            self._pending_aborted.clear()
        return [Event(r.client, r.rid, [], [], "error", ("StageFailed", message, stage)) for r in failed]

    def _stop_images(self) -> None:
        if self._images_thread is not None:
            self._images_q.put(None)

    def _attach_images(self, r: Request, ip) -> None:
        """Rows for the request's images, resident in this (intake) engine: computed here when the tower is this
        stage, else computed by the tower stage and published by host bounce. NEVER across contexts refuses
        (_plan_images, before any work)."""
        self.here()
        pixels = [ii.pixel_values for ii in ip.images]
        grids = [ii.grid_thw for ii in ip.images]
        if self.tower is not None:
            try:
                rows = self._tower_rows(pixels, grids)
            except MemraError:
                raise
            except Exception as e:  # the tower itself broke: this request fails typed, naming the stage (which
                # lives on: no stage index, so that a replaying client does not wait for a recovery)
                raise StageFailed(f"stage {self.index} (vision tower) failed: {type(e).__name__}: {e}") from None
            ov = EmbedOverlay.new_published(self.engine, self.engine, self.publish_mode, rows, ip.spans)
        else:
            ov = self._remote_rows(pixels, grids, ip.spans)
        r.prompt, r.positions_3L, r.rope_delta, r.images = ip.prompt, ip.positions_3L, ip.rope_delta, ov

    def _remote_rows(self, pixels, grids, spans) -> EmbedOverlay:
        """Rows from the tower stage by host bounce: it writes their bytes into one of this stage's publication
        slots (Ray carries the request and the rows' description only), and they land here from the slot. The
        slots were made with the receiving side (relink), which reports their name prefix for clean-up."""
        nrows = max((off + n for _, off, n in spans), default=0)
        nbytes = nrows * self.mc.text.hidden_size * self.dtype.itemsize
        with self.pub_inbox.slot(nbytes, self.placement.timeouts.step_s) as (name, size, buf):
            pub = self.remote_encode(pixels, grids, spans, (name, size))
            ov = pub.land(self.engine, host=buf)
        if pub.data is None:
            with self._pub_lock:
                self.pub_inbox.landed += 1
        return ov

    def _tower_rows(self, pixels, grids) -> torch.Tensor:
        if self.tower is None:
            raise InputError("this stage is not the tower engine")
        pv = torch.cat([torch.as_tensor(p) for p in pixels]).to(self.spec.device, self.dtype)
        with torch.inference_mode():
            rows = self.tower(pv, grids)
        if not bool(torch.isfinite(rows).all()):   # finite pixels can still overflow the tower (3e38): refuse here,
            # not a request that decodes NaN
            raise InputError(f"the images' {rows.shape[0]} embedding rows are not all finite ({self.dtype} tower): "
                             f"pixel values of magnitude up to {float(pv.abs().max()):.3g} overflow it; pass "
                             f"normalised pixel values (the processor's, about -3..3)")
        return rows

    def encode_images(self, pixel_values: list, grids: list, spans: list, inbox: tuple | None = None):
        """The tower side of a cross-actor publication: compute the rows here, dtoh them (host bounce) into the
        intake's publication slot `inbox` (name, size), or carried in the answer when none is named."""
        self.here()
        rows = self._tower_rows(pixel_values, grids)
        if inbox is None:
            return publish_out(self.engine, rows, spans)
        from .pub_inbox import InboxWriter
        with self._pub_lock:
            if self.inbox_writer is None:
                self.inbox_writer = InboxWriter(self.engine)
        with self.inbox_writer.lease(*inbox) as into:
            return publish_out(self.engine, rows, spans, into=into)
