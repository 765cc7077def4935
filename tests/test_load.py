"""Load through memra_pp.launch: 500 concurrent requests on two CPU stages, in rounds. None may be lost or
duplicated, each must equal its solo run, and no stage process's memory may grow round over round."""
import sys
from pathlib import Path

import memra_pp
from conftest_models import tiny_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from load import config, prompts, run_round  # noqa: E402

N, NEW, ROUNDS = 500, 4, 3


def test_500_concurrent_requests(ray_cluster):
    """Every one of 500 concurrent requests must come back once, with NEW tokens equal to its solo run; stage RSS
    after rounds 2.. must stay within 10% of round 1 (the first round warms the allocator)."""
    _, path = tiny_checkpoint("dense", False)
    ps = prompts(N)
    with memra_pp.launch(config(str(path))) as dep:
        c = dep.client()
        solo = {tuple(p): c.generate(p, max_new_tokens=NEW).token_ids for p in ps[:50]}
        before = sum(s["microbatches"] for s in dep.stats()["stages"])
        rounds = []
        for _ in range(ROUNDS):
            r = run_round(dep, c, ps, NEW)
            res = r.pop("results")
            assert len(res) == N
            assert all(len(x.token_ids) == NEW and x.finish_reason == "length" for x in res), \
                "a lost or duplicated event changes a result's length"
            bad = [i for i, (p, x) in enumerate(zip(ps, res)) if x.token_ids != solo[tuple(p)]]
            assert not bad, f"{len(bad)} results differ from their solo runs, first {bad[:5]}"
            rounds.append(r)
        assert not c._tracks and not c._held, "the client must hold no request after the rounds"
        st = dep.stats()["stages"]
        assert sum(s["microbatches"] for s in st) > before
        first = rounds[0]["rss_mib"]
        for r in rounds[1:]:
            for a, b in zip(first, r["rss_mib"]):
                assert b <= a * 1.10, f"stage RSS grew from {a:.1f} to {b:.1f} MiB: {[x['rss_mib'] for x in rounds]}"
