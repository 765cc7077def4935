"""Per-client event mailboxes on the intake stage: the scheduler posts, clients long-poll (one call per batch)."""
from __future__ import annotations

import threading
from collections import defaultdict, deque


class Mailboxes:
    GONE_KEPT = 65536       # closed clients remembered (so that their requests' last events are dropped)

    def __init__(self):
        self._cv = threading.Condition()
        self._boxes: dict[str, deque] = defaultdict(deque)
        self._gone: dict[str, None] = {}       # closed clients, oldest first
        self.polls = 0                          # poll calls served (stats: one per round per driver process)

    def post(self, events) -> None:
        if not events:
            return
        with self._cv:
            for e in events:
                if e.client not in self._gone:
                    self._boxes[e.client].append((e.rid, e.tokens, e.logprobs, e.finish, e.error))
            self._cv.notify_all()

    def forget(self, client: str) -> None:
        """A closed client: its mailbox goes, and so does whatever is posted to it later (its aborted requests' last
        events), instead of a box per client ever seen, filling for nobody."""
        with self._cv:
            self._boxes.pop(client, None)
            self._gone[client] = None
            if len(self._gone) > self.GONE_KEPT:
                del self._gone[next(iter(self._gone))]

    def __len__(self) -> int:
        with self._cv:
            return len(self._boxes)

    def poll(self, clients: list[str], timeout: float) -> dict[str, list[tuple]]:
        """Every event queued for each of `clients` (those with any), waiting up to `timeout` seconds for the first
        one: a driver process polls once for all its clients (memra_pp.client._Poller), not once per client."""
        self.polls += 1
        with self._cv:
            live = [c for c in clients if c not in self._gone]   # (a poll on its way when its client closed)
            boxes = [self._boxes[c] for c in live]
            if not any(boxes):
                self._cv.wait_for(lambda: any(boxes), timeout)
            out = {}
            for c, box in zip(live, boxes):
                if box:
                    out[c] = list(box)
                    box.clear()
            return out
