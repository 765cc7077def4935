"""The stage actor: a thin Ray shell over StageRunner, one process per stage; method names match the runner's."""
from __future__ import annotations

import ray

from .runner import StageRunner


@ray.remote(max_concurrency=16)
class StageActor:
    """Ray runs each call on a pool thread; CUDA work there needs the stage's context made current first
    (StageRunner methods that touch the device call `here()`)."""

    def __init__(self):
        self.runner = StageRunner()

    def probe_transport(self, src: int, dst: int) -> dict:
        return self.runner.probe_transport(src, dst)

    def setup(self, placement: dict, plan: dict, index: int, run_dir: str, transport: str = "shm",
              switches: dict | None = None) -> dict:
        return self.runner.setup(placement, plan, index, run_dir, transport, switches)

    def kv_report(self) -> dict:
        return self.runner.kv_report()

    def set_kv_pages(self, pages: int) -> None:
        return self.runner.set_kv_pages(pages)

    def connect(self, downstream, ring, timeout: float, tower=None, tower_ctx=None, kv=None) -> None:
        if tower is not None:   # the intake asks the tower actor for rows; the runner never sees Ray
            from ..rayutil import get
            self.runner.remote_encode = lambda *a: get(tower.encode_images.remote(*a), timeout, "vision tower")
        return self.runner.connect(downstream, ring, timeout, tower_ctx, kv)

    def unlink_shm(self, names: list) -> int:
        """Unlink a killed stage's receiving segments on this node (the supervisor asks its replacement)."""
        from ..shm import unlink_shm
        return unlink_shm(names)

    def encode_images(self, pixel_values: list, grids: list, spans: list, inbox=None):
        return self.runner.encode_images(pixel_values, grids, spans, inbox)

    def start(self) -> None:
        return self.runner.start()

    def submit(self, req: dict) -> None:
        return self.runner.submit(req)

    def abort(self, rid: str) -> None:
        return self.runner.abort(rid)

    def poll(self, client: str, timeout: float) -> list:
        return self.runner.poll(client, timeout)

    def forget_client(self, client: str) -> None:
        return self.runner.forget_client(client)

    def load_adapter(self, name: str, path: str, slot: int) -> None:
        return self.runner.load_adapter(name, path, slot)

    def unload_adapter(self, slot: int) -> None:
        return self.runner.unload_adapter(slot)

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

    def adapters(self, loaded_only: bool = False) -> dict:
        return self.runner.adapters(loaded_only)

    def run_check(self, name: str, *args):
        from ..battery_stage import CHECKS
        self.runner.here()
        return CHECKS[name](self.runner, *args)

    def describe(self) -> dict:
        return self.runner.describe()

    def stats(self, reset: bool = False, timeline: bool = False) -> dict:
        return self.runner.stats(reset, timeline)

    def inject_stall(self, seconds: float) -> None:
        return self.runner.inject_stall(seconds)

    def ping(self) -> int:
        return self.runner.ping()

    def pid(self) -> int:
        return self.runner.pid()

    def stop(self) -> None:
        return self.runner.stop()

    def health(self) -> dict:
        return self.runner.health()

    def halt(self, stage: int, message: str) -> None:
        return self.runner.halt(stage, message)

    def relink(self, run_dir: str, transport: str = "shm") -> dict:
        return self.runner.relink(run_dir, transport)
