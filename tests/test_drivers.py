"""The intake aborts the requests of a driver that ended without closing its clients (stages/drivers.py), in
process against a StageRunner (end to end, with a SIGKILLed driver: tests/test_reliability.py)."""
import time
import types

from memra_pp.model.sampling import SamplingParams
from memra_pp.scheduler import Event, Request, Scheduler
from memra_pp.stages import drivers
from memra_pp.stages.runner import StageRunner


def _runner():
    r = StageRunner()
    r.index, r.spec = 0, types.SimpleNamespace(intake=True)
    r.scheduler = Scheduler(4, 1, 16, 64)
    r._reaper_stop.set()            # (no reaper: the test calls reap() itself)
    return r


def test_only_a_stale_group_whose_job_has_ended_is_reaped(monkeypatch):
    """Groups "a" and "b" hold requests; "c" is "a"'s job too but holds none. Only a group that has not polled for
    STALE_S is looked up, and only one whose job Ray says has ended loses its requests (aborted through the
    intake's inbox, as a client's abort; one still in the inbox too) and its clients' mailboxes; a stale group with
    a live job keeps both."""
    r = _runner()
    asked = []
    monkeypatch.setattr(drivers, "dead_jobs", lambda jobs: (asked.append(sorted(jobs)), {"job-a"} & jobs)[1])
    for rid, client, job in (("a1", "a.1", "job-a"), ("a2", "a.2", "job-a"), ("b1", "b.1", "job-b")):
        r.scheduler.add(Request(rid, client, [1, 2, 3], 4, SamplingParams()))
        r._driver_seen(client.split(".")[0], job)
    r.inbox.put(("req", Request("a3", "a.1", [4], 4, SamplingParams())))     # submitted, not yet taken by the loop
    r._driver_seen("c", "job-a")
    r.mail.post([Event("a.1", "a1", [7], [0.0], None, None), Event("b.1", "b1", [7], [0.0], None, None)])
    assert r.reap() == 0 and asked == []            # every group polled or submitted just now: nobody asked

    def last_seen(group, ago):                      # (backdated, not slept: a slow machine cannot move a window)
        r._seen[group] = time.monotonic() - ago
    for g in ("a", "c"):
        last_seen(g, 2 * r.STALE_S)                 # b polled just now: not stale
    assert r.reap() == 3 and asked == [["job-a"]]   # (c holds no request and no mailbox: not looked up)
    assert "c" not in r._job_of                     # (nor tracked, until its next submit or poll)
    items = [r.inbox.get_nowait() for _ in range(4)]
    assert items[0][0] == "req" and items[1:] == [("abort", "a3"), ("abort", "a1"), ("abort", "a2")], items
    assert r.inbox.empty()          # (the one in the inbox too: its abort comes after it)
    assert len(r.mail) == 1 and r.mail.poll("b", 0) and r.reaped == 3
    last_seen("b", 2 * r.STALE_S)
    assert r.reap() == 0 and asked[-1] == ["job-b"]  # b stale now, its job alive: it keeps its request
    assert r.inbox.empty() and time.monotonic() - r._seen["b"] < r.STALE_S    # and is looked up again STALE_S on


def test_the_reaper_ends_with_its_stage(monkeypatch):
    """The reaper thread looks every REAP_EVERY_S until the stage's stop, which ends it (it had no stop, and ran on
    in a stopped stage's process); a stopped stage starts no reaper again."""
    r = StageRunner()
    looks = []
    monkeypatch.setattr(r, "REAP_EVERY_S", 0.01)
    monkeypatch.setattr(r, "reap", lambda: looks.append(1) or 0)
    r._driver_seen("g", "job-a")
    reaper = r._reaper
    deadline = time.monotonic() + 10
    while len(looks) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(looks) >= 3 and reaper.is_alive()
    r._stop_reaper()
    assert not reaper.is_alive()
    n = len(looks)
    time.sleep(0.05)
    assert len(looks) == n
    r._driver_seen("h", "job-b")
    assert r._reaper is reaper      # no new one
