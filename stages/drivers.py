"""The intake's view of the drivers its requests come from: a driver process that ended without closing its clients
(SIGKILLed, crashed, a host gone) leaves its requests running to max_new_tokens, holding batch slots and KV pages
that admission gives no one else, and its mailboxes filling for nobody. vLLM aborts a request when its HTTP client
disconnects; here the signal is Ray's: a deployment handle's poller polls its group every round while it has
requests, so a group with requests that has not polled for STALE_S (2 s) is looked up in Ray's job table, and if its
driver's job has ended, its requests are aborted and its clients' mailboxes forgotten. A driver that is only slow
(paused in a debugger, its poller starved) has a live job and keeps its requests. Runs in the intake's process,
mixed into StageRunner.
"""
from __future__ import annotations

import logging
import threading
import time

from .events import group_of

log = logging.getLogger("memra_pp")


def dead_jobs(jobs: set[str]) -> set[str]:
    """Those of `jobs` (hex ids) that Ray's job table says have ended (one call to the GCS, through this worker's
    GCS client: ray._private.state's table is a driver's only)."""
    import ray
    # (the skips: the GCS would read every job's submission record and ask every live driver for its running
    # tasks, as Ray's own liveness count does not)
    info = ray._private.worker.global_worker.gcs_client.get_all_job_info(
        skip_submission_job_info_field=True, skip_is_running_tasks_field=True, timeout=5)
    return {k.hex() for k, v in info.items() if v.is_dead and k.hex() in jobs}


class DriversMixin:
    STALE_S = 2.0       # a group with requests that has not polled for this long: its driver is looked up (a live
    #                     one, every STALE_S: one call to the GCS; a poll queued behind others is late, not gone)
    REAP_EVERY_S = 1.0  # how often the reaper looks

    def _drivers_init(self) -> None:
        self._drivers_lock = threading.Lock()
        self._job_of: dict[str, str] = {}       # group -> its driver's Ray job id (hex), from its submits
        self._seen: dict[str, float] = {}       # group -> when it last polled or submitted (time.monotonic())
        self.reaped = 0                         # requests aborted because their driver had ended (stats)
        self._reaper: threading.Thread | None = None
        self._reaper_stop = threading.Event()

    def _driver_seen(self, group: str, job: str | None = None) -> None:
        with self._drivers_lock:
            self._seen[group] = time.monotonic()
            if job:
                self._job_of[group] = job
        if self._reaper is None and job:
            self._start_reaper()

    def _start_reaper(self) -> None:
        with self._drivers_lock:
            if self._reaper is not None or self._reaper_stop.is_set():
                return
            self._reaper = threading.Thread(target=self._reap_loop, name="memra-reaper", daemon=True)
        self._reaper.start()

    def _stop_reaper(self) -> None:
        """The stage's stop: the reaper ends at its next look (a look under way, a GCS call, is not waited out)."""
        with self._drivers_lock:
            self._reaper_stop.set()
            reaper = self._reaper
        if reaper is not None:
            reaper.join(timeout=self.REAP_EVERY_S)

    def _reap_loop(self) -> None:
        while not self._reaper_stop.wait(self.REAP_EVERY_S):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - a failed look (the GCS busy, say) is tried again next round
                log.exception("intake: looking for the requests of ended drivers failed")

    def _requests_by_group(self) -> dict[str, list[str]]:
        """group -> the rids it has waiting for their images, submitted (in the inbox, or taken from it by the loop
        and not yet added), waiting or running: in the order a request goes through them (adapter_users' order), so
        one moving on meanwhile is still seen. (Each abort queues behind its request in the inbox.)"""
        out: dict[str, dict[str, None]] = {}     # (ordered sets: a request seen in two places counts once)
        with self._pending_lock:
            reqs = list(self._pending.values())
        with self.inbox.mutex:
            reqs += [item[1] for item in [*self.inbox.queue, self.inbox.taken] if item and item[0] == "req"]
        sch = self.scheduler
        with sch.mu:
            reqs += list(sch.waiting) + [s.req for s in sch.active.values()]
        for r in reqs:
            out.setdefault(group_of(r.client), {})[r.rid] = None
        return {g: list(rids) for g, rids in out.items()}

    def reap(self) -> int:
        """Abort the requests of groups whose driver has ended and forget their mailboxes (a group with either that
        has not polled for STALE_S is looked up; one whose driver lives is looked up again STALE_S later); returns
        how many requests it aborted."""
        now = time.monotonic()
        with self._drivers_lock:    # (first, and cheap: groups that poll walk no request list every round)
            late = {g: j for g, j in self._job_of.items() if now - self._seen.get(g, now) > self.STALE_S}
        if not late:
            return 0
        by_group = self._requests_by_group()
        busy = set(by_group) | self.mail.groups()
        with self._drivers_lock:    # late with nothing here: not tracked until its next submit or poll (unless one
            for g in late.keys() - busy:                        # came meanwhile)
                if now - self._seen.get(g, now) > self.STALE_S:
                    self._job_of.pop(g, None)
                    self._seen.pop(g, None)
        stale = {g: j for g, j in late.items() if g in busy}
        if not stale:
            return 0
        dead = dead_jobs(set(stale.values()))
        n = 0
        for g, job in stale.items():
            if job not in dead:
                with self._drivers_lock:
                    self._seen[g] = now
                continue
            rids = by_group.get(g, [])
            for rid in rids:
                self.abort(rid)
            n += len(rids)
            self.mail.forget_group(g)
            with self._drivers_lock:
                self._job_of.pop(g, None)
                self._seen.pop(g, None)
            log.warning(f"intake: the driver of client group {g} (Ray job {job}) has ended: its {len(rids)} "
                        f"request(s) were aborted and its mailboxes forgotten")
        self.reaped += n
        return n
