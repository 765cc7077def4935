"""A request held by its client for a replay (recover: replay) still uses its adapter: an unload during the recovery
must not take it away (the replay was refused: "unknown adapter")."""
import re
import time

import pytest
import ray

import memra_pp
import threads
from conftest_models import connected, tiny_checkpoint
from memra_pp.errors import StageFailed
from test_reliability import Stream, config, kill

P1 = (5, 17, 42, 7, 23)


def replay_cfg(path, n, name, **extra):
    return {**config(path, n, recover="replay"), "name": name, **extra}


@pytest.fixture(scope="module")
def dep(ray_cluster):
    """One detached 2-stage deployment (recover: replay, heartbeat 0.5 s, 2 adapter slots) for both tests (a stage
    process costs the suite seconds to start); each kills its stage 1 and waits for the recovery."""
    from test_adapters import adapter
    _, path = tiny_checkpoint("dense", False)
    adapter("dense", False, "A")                    # (made before the deployment: PEFT, on disk)
    d = memra_pp.launch(replay_cfg(path, 2, "hrunload", adapters={"max_loras": 2, "max_rank": 8}), detached=True)
    try:
        yield d
    finally:
        d.shutdown()


def with_a(dep):
    """`dep` serving, adapter "a" (adapter A) just loaded as on a fresh launch, nothing else loaded."""
    from test_adapters import adapter
    dep.wait_ready(60)
    for name in ray.get(dep.actors[0].adapters.remote(), timeout=30):
        dep.unload_adapter(name)
    dep.load_adapter("a", adapter("dense", False, "A")[1])
    return dep


# -- adapters of requests held for a replay ------------------------------------------------------------------------
def test_an_unload_racing_a_connected_handles_replay_is_refused(dep):
    """A connect()ed handle's request with an adapter is held across a recovery; the launching process asks to unload
    that adapter during the recovery (its unload waits for the recovery's end). Uninterrupted, that unload is
    refused ("still used by 1 request") and the request ends with its tokens: so must it be here. The connected
    handle replays only at its next read of the launcher's recovery record (RemoteSupervisor.POLL_S), after the
    launcher's supervisor lock is released, and a held request is not an adapter user: the unload went first, and
    the replay was refused (unknown adapter)."""
    from memra_pp.errors import InputError
    new = 300      # still decoding when the unload, after its wait for replays, counts the users
    dep = with_a(dep)
    with connected("hrunload") as other:     # (let go at the end; its shutdown would stop the deployment)
        c = other.client()
        want = c.generate(list(P1), max_new_tokens=new, adapter="a", timeout=60)
        s = Stream(c, P1, new, adapter="a")
        s.wait_tokens(3)
        assert s.t_end is None
        kill(dep, 1, "SIGKILL")
        deadline = time.monotonic() + 20
        while dep.supervisor.ready.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not dep.supervisor.ready.is_set(), "the launcher must be recovering"
        th, out = threads.start(dep.unload_adapter, "a")
        s.join(90)
        th.join(60)
        assert s.error is None, f"the held request was lost to an unload it would have refused: {s.error}"
        assert s.tokens == want.token_ids
        assert isinstance(out["r"], InputError) and "still used by 1 request" in str(out["r"]), out


def test_an_unload_right_after_a_kill_does_not_take_a_held_requests_adapter(dep):
    """The launcher's own handle: stage 1 is SIGKILLed under a request with an adapter and the operator unloads that
    adapter at once, before the supervisor has noticed the loss (heartbeat_s 0.5). Uninterrupted, the unload is
    refused ("still used by 1 request"); the interrupted request is only held for its replay, so the unload must
    still be refused (or fail) without taking the adapter from under it: the request must end with its tokens."""
    new = 64
    dep = with_a(dep)
    c = dep.client()
    want = c.generate(list(P1), max_new_tokens=new, adapter="a", timeout=60)
    for _ in range(3):
        s = Stream(c, P1, new, adapter="a")
        s.wait_tokens(3)
        assert s.t_end is None
        kill(dep, 1, "SIGKILL")
        deadline = time.monotonic() + 10
        while not c._held and time.monotonic() < deadline:     # the intake's link break: the request is held
            time.sleep(0.002)
        if c._held and dep.supervisor.ready.is_set():
            break
        # a heartbeat fell between the kill and the hold (it can under the suite's load): the supervisor saw the
        # loss first, so the premise does not hold; let this one replay, and kill again
        s.join(90)
        dep.wait_ready(60)
        assert s.error is None and s.tokens == want.token_ids
    assert c._held and dep.supervisor.ready.is_set(), "the premise: held, the loss not yet seen by the supervisor"
    try:
        dep.unload_adapter("a")
        unload = "unloaded"
    except Exception as e:  # noqa: BLE001
        unload = e
    s.join(90)
    dep.wait_ready(60)
    assert s.error is None, f"the held request lost its adapter (unload: {unload!r}): {s.error}"
    assert s.tokens == want.token_ids
    # the intake had ended the request for the lost stage: the unload is refused until a recovery has run
    assert isinstance(unload, StageFailed) and unload.stage == 1, unload
    assert re.fullmatch(r"adapter 'a' cannot be unloaded now: stage 1 is lost: .*, and the deployment has not "
                        r"recovered yet \(requests held for a replay may still use it\); retry once "
                        r"dep.wait_ready\(\) returns", str(unload), re.S), unload

