"""Per-client event mailboxes on the intake stage: the scheduler posts, clients long-poll (one call per batch)."""
from __future__ import annotations

import threading
from collections import defaultdict, deque


class Mailboxes:
    GONE_KEPT = 65536       # closed clients remembered (so that their requests' last events are dropped)

    def __init__(self):
        self._cv = threading.Condition()
        self._boxes: dict[str, deque] = {}
        # a deployment handle's poller polls for its group: its clients' ids are "GROUP.CLIENT" (memra_pp.client), and
        # a client whose first events come while a poll is out is in it at once (a poll naming its clients missed one
        # made meanwhile for up to the poll's 0.2 s)
        self._groups: dict[str, set[str]] = defaultdict(set)
        self._gone: dict[str, None] = {}       # closed clients, oldest first
        self.polls = 0                          # poll calls served (stats: one a round per deployment handle)

    def post(self, events) -> None:
        if not events:
            return
        with self._cv:
            for e in events:
                if e.client not in self._gone:
                    box = self._boxes.get(e.client)
                    if box is None:
                        box = self._boxes[e.client] = deque()
                        self._groups[group_of(e.client)].add(e.client)
                    box.append((e.rid, e.tokens, e.logprobs, e.finish, e.error))
            self._cv.notify_all()

    def forget(self, client: str) -> None:
        """A closed client: its mailbox goes, and so does whatever is posted to it later (its aborted requests' last
        events), instead of a box per client ever seen, filling for nobody."""
        with self._cv:
            if self._boxes.pop(client, None) is not None:
                members = self._groups[group_of(client)]
                members.discard(client)
                if not members:
                    del self._groups[group_of(client)]
            self._gone[client] = None
            if len(self._gone) > self.GONE_KEPT:
                del self._gone[next(iter(self._gone))]

    def groups(self) -> set[str]:
        """The groups that have a mailbox."""
        with self._cv:
            return set(self._groups)

    def forget_group(self, group: str) -> None:
        """Forget every client of `group` (a deployment handle whose driver has ended: drivers.py)."""
        with self._cv:
            members = list(self._groups.get(group, ()))
        for c in members:
            self.forget(c)

    def __len__(self) -> int:
        with self._cv:
            return len(self._boxes)

    def poll(self, group: str, timeout: float) -> dict[str, list[tuple]]:
        """Every event queued for the clients of `group` (those with any), waiting up to `timeout` seconds for the
        first one: a deployment handle's poller polls once a round for all its clients (memra_pp.client._Poller)."""
        with self._cv:
            self.polls += 1

            def ready():
                return [c for c in self._groups.get(group, ()) if self._boxes[c]]
            got = ready()
            if not got and self._cv.wait_for(ready, timeout):
                got = ready()
            out = {}
            for c in got:
                out[c] = list(self._boxes[c])
                self._boxes[c].clear()
            return out


def group_of(client: str) -> str:
    """A client id's poller group: what comes before its first '.' (an id without one is a group of its own)."""
    return client.partition(".")[0]
