"""The stage actor: a thin Ray shell over StageRunner, one process per stage; method names match the runner's."""
from __future__ import annotations

import ray


CONTROL = "control"     # quick calls that must always find a thread: heartbeats, aborts, stats
POLLS = "polls"         # the drivers' long polls (0.2 s each): one per deployment handle, for all its clients


@ray.remote(max_concurrency=16, concurrency_groups={CONTROL: 4, POLLS: 32})
class StageActor:
    """Ray runs each call on a pool thread; CUDA work there needs the stage's context made current first
    (StageRunner methods that touch the device call `here()`). The default group's 16 threads take the calls that
    may wait (submits, adapter loads, the tower's encodes, setup); the supervisor's heartbeats, aborts and stats
    have a group of their own and the clients' polls another, so that neither waits behind them (a burst of
    submits once held every thread past the heartbeat's deadline, and the stage was restarted)."""

    def __init__(self):
        # the runner (and torch with it) is imported here, in the stage's process, not with this module: a client's
        # ray.get_actor loads this class to make its handle, and a CLI `status` or `generate` has no use for torch
        # (measured: 1.6 s of a 2.9 s `memra-pp status`)
        from .runner import StageRunner
        self.runner = StageRunner()

    def probe_transport(self, src: int, dst: int) -> dict:
        return self.runner.probe_transport(src, dst)

    def setup(self, placement: dict, plan: dict, index: int, run_dir: str, transport: str = "shm",
              switches: dict | None = None) -> dict:
        info = self.runner.setup(placement, plan, index, run_dir, transport, switches)
        info["proc"] = self.proc()      # a supervisor kills a stage that stops answering by it (kill_actor)
        return info

    @ray.method(concurrency_group=CONTROL)
    def proc(self) -> dict:
        """This stage's process (proc_identity), before its setup: a restart names a new actor's process at once."""
        from ..rayutil import proc_identity
        return proc_identity()

    @ray.method(concurrency_group=CONTROL)
    def kv_report(self) -> dict:
        return self.runner.kv_report()

    def set_kv_pages(self, pages: int) -> None:
        return self.runner.set_kv_pages(pages)

    def connect(self, downstream, ring, timeout: float, tower=None, tower_ctx=None, kv=None) -> None:
        if tower is not None:   # the intake asks the tower actor for rows; the runner never sees Ray
            from ..rayutil import get
            ti = self.runner.plan.tower_index      # its death is that stage's loss, not the intake's
            self.runner.remote_encode = lambda *a: get(tower.encode_images.remote(*a), timeout,
                                                       f"stage {ti} (vision tower)", stage=ti)
        return self.runner.connect(downstream, ring, timeout, tower_ctx, kv)

    def unlink_shm(self, names: list) -> int:
        """Unlink a killed stage's receiving segments on this node (the supervisor asks its replacement)."""
        from ..shm import unlink_shm
        return unlink_shm(names)

    def encode_images(self, pixel_values: list, grids: list, spans: list, inbox=None):
        return self.runner.encode_images(pixel_values, grids, spans, inbox)

    def start(self, recovered: bool = False) -> None:
        return self.runner.start(recovered)

    def submit(self, req: dict) -> None:
        return self.runner.submit(req)

    @ray.method(concurrency_group=CONTROL)
    def abort(self, rid: str) -> None:
        return self.runner.abort(rid)

    @ray.method(concurrency_group=POLLS)
    def poll(self, group: str, timeout: float) -> dict:
        return self.runner.poll(group, timeout)

    @ray.method(concurrency_group=CONTROL)
    def forget_client(self, client: str) -> None:
        return self.runner.forget_client(client)

    def load_adapter(self, name: str, path: str, slot: int) -> str:
        return self.runner.load_adapter(name, path, slot)

    def adapter_digest(self, slot: int) -> str | None:
        return self.runner.adapter_digest(slot)

    def unload_adapter(self, slot: int) -> None:
        return self.runner.unload_adapter(slot)

    @ray.method(concurrency_group=CONTROL)
    def adapter_users(self, slot: int) -> int:
        return self.runner.adapter_users(slot)

    def reserve_adapter(self, name: str, path: str, slot: int | None = None) -> int:
        return self.runner.reserve_adapter(name, path, slot)

    def commit_adapter(self, name: str, slot: int) -> None:
        return self.runner.commit_adapter(name, slot)

    def begin_unload(self, name: str) -> int:
        return self.runner.begin_unload(name)

    def abort_unload(self, name: str) -> None:
        return self.runner.abort_unload(name)

    def release_adapter(self, name: str) -> None:
        return self.runner.release_adapter(name)

    def registry_key(self, key: bytes | None) -> None:
        return self.runner.registry_key(key)

    @ray.method(concurrency_group=CONTROL)
    def adapters(self, loaded_only: bool = False) -> dict:
        return self.runner.adapters(loaded_only)

    def adapters_seen(self) -> tuple:
        return self.runner.adapters_seen()

    def run_check(self, name: str, *args):
        from ..battery_stage import CHECKS
        self.runner.here()
        return CHECKS[name](self.runner, *args)

    @ray.method(concurrency_group=CONTROL)
    def describe(self) -> dict:
        return self.runner.describe()

    def model_info(self) -> dict:
        return self.runner.model_info()

    @ray.method(concurrency_group=CONTROL)
    def stats(self, reset: bool = False, timeline: bool = False) -> dict:
        return self.runner.stats(reset, timeline)

    def inject_stall(self, seconds: float) -> None:
        return self.runner.inject_stall(seconds)

    def inject_fault(self, message: str) -> None:
        return self.runner.inject_fault(message)

    @ray.method(concurrency_group=CONTROL)
    def ping(self) -> int:
        return self.runner.ping()

    @ray.method(concurrency_group=CONTROL)
    def pid(self) -> int:
        return self.runner.pid()

    def stop(self) -> None:
        return self.runner.stop()

    @ray.method(concurrency_group=CONTROL)
    def health(self) -> dict:
        return self.runner.health()

    def halt(self, stage: int, message: str) -> None:
        return self.runner.halt(stage, message)

    def relink(self, run_dir: str, transport: str = "shm") -> dict:
        return self.runner.relink(run_dir, transport)
