"""The stage loops' bookkeeping that the supervisor reads (`health()["computing_s"]`: how long the oldest
microbatch not yet done has run) must be right while the primary's ring thread resolves tokens asynchronously:
an idle stage never looks stuck (also after a failed microbatch), and a microbatch hanging on the host is seen
even while an earlier one resolves. Driven with a stand-in runner (no Ray, no transport)."""
import queue
import threading
import time
import types

import pytest
import torch

from memra_pp.stages.loops import StageLoop
from memra_pp.stages.runner import StageRunner

# the intake's own check of a request's adapter as its loop takes it, over an empty registry (these requests name no
# adapter: it lets them through)
_CHECK_ADAPTER = StageRunner.check_adapter.__get__(types.SimpleNamespace(adapter_registry={},
                                                                         _registry_lock=threading.Lock()))


class Pend:
    device = None

    def __init__(self):
        self.ev = threading.Event()

    def result(self):
        assert self.ev.wait(10)
        return [1], [-0.1]


class Sampler:
    def __init__(self):
        self.pends = []

    def admit(self, *a):
        pass

    def __call__(self, out, b):
        self.pends.append(Pend())
        return self.pends[-1]


class QueueRecv:
    """A boundary receiver over a queue of (header, tensor) pairs (no slots: free has nothing to give back)."""
    _ch = None

    def __init__(self, msgs: queue.Queue):
        self.msgs = msgs

    def recv(self, timeout):
        try:
            return self.msgs.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None

    def free(self, slot):
        pass


def make_loop():
    msgs, sent = queue.Queue(), []

    def model(b, h, c, lora=None, token_overlay=None):
        if r.hang is not None:
            r.hanging.set()
            r.hang.wait(10)                # a microbatch stuck on the host (inject_stall's kind)
        return torch.zeros(1, 4)

    r = types.SimpleNamespace(
        spec=types.SimpleNamespace(primary=True), index=1, engine=types.SimpleNamespace(make_current=lambda: None),
        receiver=QueueRecv(msgs), placement=types.SimpleNamespace(timeouts=types.SimpleNamespace(step_s=3)),
        rx_hashes=None, stall_s=0.0, fault=None, model=model, cache=None, lora=None, token_overlay=None, hang=None,
        hanging=threading.Event(),
        ring=types.SimpleNamespace(send=sent.append), sender=None)
    loop = StageLoop(r)
    loop.sampler = Sampler()
    return loop, r, msgs, sent


@pytest.fixture
def running():
    loop, r, msgs, sent = make_loop()
    loop.start()
    yield loop, r, msgs, sent
    loop.stop()


def step(mb):
    return {"kind": "step", "mb": mb, "slots": [0], "starts": [3], "counts": [1], "sample": [True],
            "pos": torch.zeros(3, 1, dtype=torch.int32)}, torch.zeros(1, 4)


def wait_for(cond, s=5.0):
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < s, "timed out"
        time.sleep(0.01)


def test_idle_after_a_failed_microbatch_is_not_stuck(running):
    loop, r, msgs, sent = running
    msgs.put(step(0))
    wait_for(lambda: loop.sampler.pends)
    msgs.put(({"kind": "mb_error", "mb": 1, "stage": 0, "etype": "X", "message": "y"}, None))
    time.sleep(0.1)
    assert 0 < loop.health()["computing_s"] < 2          # step 0 is on the device
    loop.sampler.pends[0].ev.set()
    wait_for(lambda: len(sent) == 2)
    assert [m["kind"] for m in sent] == ["tokens", "mb_error"]   # in order
    time.sleep(0.2)
    assert loop.health()["computing_s"] == 0.0           # idle: nothing outstanding


def test_a_hang_is_seen_while_an_earlier_step_resolves(running):
    loop, r, msgs, sent = running
    msgs.put(step(0))
    wait_for(lambda: loop.sampler.pends)
    r.hang = threading.Event()
    msgs.put(step(1))                                     # hangs inside the model call
    assert r.hanging.wait(10)                             # (launched: not a sleep a slow machine could outlast)
    loop.sampler.pends[0].ev.set()                        # step 0's tokens come back meanwhile
    wait_for(lambda: len(sent) == 1)
    time.sleep(0.3)
    assert loop.health()["computing_s"] >= 0.3           # step 1 is still seen running
    r.hang.set()
    wait_for(lambda: len(loop.sampler.pends) == 2)
    loop.sampler.pends[1].ev.set()
    wait_for(lambda: len(sent) == 2)
    time.sleep(0.1)
    assert loop.health()["computing_s"] == 0.0 and loop.stats()["microbatches"] == 2


def test_a_failed_continuation_comes_after_the_tokens_of_the_step_before_it():
    """One stage cuts step n+1 before reading step n: when launching step n+1 fails, step n's tokens (which
    succeeded) must still reach the client first, then the error; never the other way round (which dropped them)."""
    from memra_pp.model.sampling import SamplingParams
    from memra_pp.scheduler import Request, Scheduler
    from memra_pp.stages.intake_loop import IntakeLoop
    events, calls = [], []

    class Model:
        def embed_ids(self, ids, b, token_overlay=None):
            return torch.zeros(len(ids) if ids.dim() else 1, 4)

        def __call__(self, b, h, cache, lora=None, token_overlay=None):
            calls.append(list(b.starts))
            if len(calls) == 3:
                raise RuntimeError("no room for the next step")
            logits = torch.zeros(sum(b.sample), 16)
            logits[:, 5] = 1.0
            return logits

    r = types.SimpleNamespace(
        spec=types.SimpleNamespace(primary=True), index=0, engine=types.SimpleNamespace(make_current=lambda: None),
        scheduler=Scheduler(max_batch=2, microbatches=1, prefill_chunk=64, max_context=64), inbox=queue.Queue(),
        check_adapter=_CHECK_ADAPTER,
        mail=types.SimpleNamespace(post=events.extend), model=Model(), cache=None, lora=None, token_overlay=None,
        stall_s=0.0, fault=None, ring=None, receiver=None, sender=None,
        placement=types.SimpleNamespace(timeouts=types.SimpleNamespace(step_s=3)))
    loop = IntakeLoop(r)
    r.inbox.put(("req", Request("a", "c", [1, 2, 3], 5, SamplingParams())))
    loop.start()
    try:
        wait_for(lambda: any(e.finish for e in events))
    finally:
        loop.stop()
    assert calls == [[0], [3], [4]]                       # prefill, continuation 1, continuation 2 (fails)
    assert [(e.tokens, e.finish) for e in events] == [([5], None), ([5], None), ([], "error")]
    assert "no room for the next step" in events[-1].error[1] and loop.continued == 2


def test_a_finished_sequence_gives_its_pages_back_on_every_stage():
    """A finished sequence's slot travels in the `release` of the next microbatch: every stage must give its pages
    back then (before that step's own resets and reservations), not only when the slot is next used. Two real stages
    of the tiny model, the intake and the primary loop joined in process (headers through their wire encoding)."""
    from conftest_models import tiny_checkpoint
    from memra_pp.model.sampling import SamplingParams
    from memra_pp.model.stage_model import StageModel
    from memra_pp.model.weights import SafetensorsSource
    from memra_pp.scheduler import Request, Scheduler
    from memra_pp.stages.header import decode_header, encode_header
    from memra_pp.stages.intake_loop import IntakeLoop
    _, path = tiny_checkpoint("dense", False)
    src = SafetensorsSource(path)
    models = [StageModel(src.config, a, b, intake=i == 0, primary=i == 1).load(src)
              for i, (a, b) in enumerate([(0, 4), (4, 8)])]
    caches = [m.new_cache(2, 512) for m in models]
    msgs, events = queue.Queue(), []
    common = dict(engine=types.SimpleNamespace(make_current=lambda: None), lora=None, token_overlay=None,
                  stall_s=0.0, fault=None, placement=types.SimpleNamespace(timeouts=types.SimpleNamespace(step_s=3)))

    class Send:
        def send(self, hdr, out, timeout):
            msgs.put((decode_header(encode_header(hdr)), out.clone()))

    r0 = types.SimpleNamespace(
        spec=types.SimpleNamespace(primary=False), index=0, inbox=queue.Queue(), ring=None, receiver=None,
        check_adapter=_CHECK_ADAPTER,
        sender=Send(),
        scheduler=Scheduler(max_batch=2, microbatches=1, prefill_chunk=64, max_context=512),
        mail=types.SimpleNamespace(post=events.extend), model=models[0], cache=caches[0], **common)
    r1 = types.SimpleNamespace(
        spec=types.SimpleNamespace(primary=True), index=1, receiver=QueueRecv(msgs), rx_hashes=None, sender=None,
        ring=types.SimpleNamespace(send=lambda m: r0.inbox.put(("ring", m))), model=models[1], cache=caches[1],
        **common)
    r0.inbox.put(("req", Request("long", "c", [5, 6, 7], 12, SamplingParams())))    # slot 0
    r0.inbox.put(("req", Request("short", "c", [9, 10], 2, SamplingParams())))      # slot 1, done after 2 tokens
    loops = [StageLoop(r1), IntakeLoop(r0)]
    for lp in loops:
        lp.start()
    try:
        wait_for(lambda: sum(e.finish is not None for e in events) == 2, 30)
    finally:
        for lp in loops:
            lp.stop()
    assert [e.rid for e in events if e.finish] == ["short", "long"] and all(e.finish == "length" for e in events
                                                                             if e.finish)
    for c in caches:
        assert c.owned[1] == [] and c.lens[1] == 0, "the short sequence's release must have freed its page"
        assert len(c.owned[0]) == 1             # the long one's release has no next microbatch to travel in
        assert sorted(c.free_blocks + c.owned[0]) == list(range(2, c.n_blocks))


def test_a_microbatch_failing_mid_pipeline_still_releases_its_slots_on_every_stage():
    """The microbatch that carries a finished sequence's release fails on the middle of three stages, before that
    stage's model ran: the scheduler counted those pages free when it cut the microbatch, and a microbatch cut
    since may be admitted into them. So the failing stage must release them, and the mb_error it passes on must
    carry them to the stages after it: with no microbatch after the failure, every stage has given the finished
    sequence's pages back. (Once, only the next microbatch released them again, after one cut since was already
    admitted against them.) Three real stages of the tiny model in process, headers through their wire encoding."""
    from conftest_models import tiny_checkpoint
    from memra_pp.model.sampling import SamplingParams
    from memra_pp.model.stage_model import StageModel
    from memra_pp.model.weights import SafetensorsSource
    from memra_pp.scheduler import Request, Scheduler
    from memra_pp.stages.header import decode_header, encode_header
    from memra_pp.stages.intake_loop import IntakeLoop
    _, path = tiny_checkpoint("dense", False)
    src = SafetensorsSource(path)
    spans = [(0, 3), (3, 6), (6, 8)]
    models = [StageModel(src.config, a, b, intake=i == 0, primary=i == 2).load(src) for i, (a, b) in enumerate(spans)]
    caches = [m.new_cache(2, 512) for m in models]
    links, events, seen = [queue.Queue(), queue.Queue()], [], []
    common = dict(engine=types.SimpleNamespace(make_current=lambda: None), lora=None, token_overlay=None,
                  stall_s=0.0, fault=None, placement=types.SimpleNamespace(timeouts=types.SimpleNamespace(step_s=3)))

    class Send:
        def __init__(self, q):
            self.q = q

        def send(self, hdr, out, timeout):
            self.q.put((decode_header(encode_header(hdr)), None if out is None else out.clone()))

    def middle(b, h, cache, lora=None, token_overlay=None):
        seen.append(list(b.release))
        if b.release:                   # the step after the short one finished: fails before the model ran
            raise RuntimeError("injected: stage 1 failed")
        return models[1](b, h, cache, lora=lora, token_overlay=token_overlay)

    r0 = types.SimpleNamespace(
        spec=types.SimpleNamespace(primary=False), index=0, inbox=queue.Queue(), ring=None, receiver=None,
        check_adapter=_CHECK_ADAPTER,
        sender=Send(links[0]), scheduler=Scheduler(max_batch=2, microbatches=1, prefill_chunk=64, max_context=512),
        mail=types.SimpleNamespace(post=events.extend), model=models[0], cache=caches[0], **common)
    r1 = types.SimpleNamespace(
        spec=types.SimpleNamespace(primary=False), index=1, receiver=QueueRecv(links[0]), rx_hashes=None,
        sender=Send(links[1]), ring=None, model=middle, cache=caches[1], **common)
    r2 = types.SimpleNamespace(
        spec=types.SimpleNamespace(primary=True), index=2, receiver=QueueRecv(links[1]), rx_hashes=None, sender=None,
        ring=types.SimpleNamespace(send=lambda m: r0.inbox.put(("ring", m))), model=models[2], cache=caches[2],
        **common)
    r0.inbox.put(("req", Request("long", "c", [5, 6, 7], 12, SamplingParams())))    # slot 0
    r0.inbox.put(("req", Request("short", "c", [9, 10], 2, SamplingParams())))      # slot 1, done after 2 tokens
    loops = [StageLoop(r2), StageLoop(r1), IntakeLoop(r0)]
    for lp in loops:
        lp.start()
    try:
        wait_for(lambda: sum(e.finish is not None for e in events) == 2, 30)
        time.sleep(0.2)                 # (nothing more may run: no request is left)
    finally:
        for lp in loops:
            lp.stop()
    fin = [(e.rid, e.finish) for e in events if e.finish]
    assert fin == [("short", "length"), ("long", "error")], fin
    assert "injected: stage 1 failed" in [e for e in events if e.finish == "error"][0].error[1]
    assert seen[-1] == [1] and seen.count([1]) == 1, seen      # the path under test ran, once
    # full attention at layers 3 and 7: stage 0 (layers 0-2) has no KV pages; the middle stage and the last do
    assert caches[0].owned == [[], [], []]
    for i, c in enumerate(caches[1:], 1):
        assert c.owned[1] == [] and c.lens[1] == 0, f"stage {i} still holds the finished sequence's pages"
        assert len(c.owned[0]) == 1, (i, c.owned)  # the failed long one's release has no next microbatch to travel in
    assert 1 not in loops[0].sampler.params, "the primary must forget a released slot's sampling params"


def test_a_loop_left_running_by_a_halt_touches_only_its_own_links():
    """halt() waits 10 s for a loop still computing; one that finishes later must not free its slot on, nor send its
    stale microbatch through, the links relink() made meanwhile (the new receiver's slot of that number would be
    overwritten under a computation): it frees its own receiver's slot and sends nothing."""
    class Recv(QueueRecv):          # (one that records the slots it was given back)
        def __init__(self):
            super().__init__(queue.Queue())
            self.freed = []

        def free(self, slot):
            self.freed.append(slot)

    class Send:
        def __init__(self):
            self.sent = []

        def send(self, h, t, timeout=None):
            self.sent.append(h["mb"])

    old_rx, old_tx, new_rx, new_tx = Recv(), Send(), Recv(), Send()
    r = types.SimpleNamespace(spec=types.SimpleNamespace(primary=False), index=1, ring=None, rx_hashes=None,
                              engine=types.SimpleNamespace(make_current=lambda: None, is_cuda=False),
                              receiver=old_rx, sender=old_tx,
                              placement=types.SimpleNamespace(timeouts=types.SimpleNamespace(step_s=3)))
    loop = StageLoop(r)
    gate, computing = threading.Event(), threading.Event()
    loop.compute = lambda b, view, wait=True: (computing.set(), gate.wait(10), torch.zeros(1, 4))[-1]
    old_rx.msgs.put(({"kind": "step", "mb": 7, "slot": 0, "slots": [0], "starts": [0], "counts": [1],
                   "sample": [False], "pos": torch.zeros(3, 1, dtype=torch.int32)}, torch.zeros(1, 4)))
    loop.start()
    assert computing.wait(10)
    loop.stopping.set()                       # halt(): the join gives up while the compute hangs
    r.receiver, r.sender = new_rx, new_tx     # relink()
    gate.set()
    loop.thread.join(10)
    assert (old_rx.freed, new_rx.freed, old_tx.sent, new_tx.sent) == ([0], [], [], [])
