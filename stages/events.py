"""Per-client event mailboxes on the intake stage: the scheduler posts, clients long-poll (one call per batch)."""
from __future__ import annotations

import threading
from collections import defaultdict, deque


class Mailboxes:
    def __init__(self):
        self._cv = threading.Condition()
        self._boxes: dict[str, deque] = defaultdict(deque)

    def post(self, events) -> None:
        if not events:
            return
        with self._cv:
            for e in events:
                self._boxes[e.client].append((e.rid, e.tokens, e.logprobs, e.finish, e.error))
            self._cv.notify_all()

    def poll(self, client: str, timeout: float) -> list[tuple]:
        """Every event queued for `client`, waiting up to `timeout` seconds for the first one."""
        with self._cv:
            box = self._boxes[client]
            if not box:
                self._cv.wait_for(lambda: bool(box), timeout)
            out = list(box)
            box.clear()
            return out
