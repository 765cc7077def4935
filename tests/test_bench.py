"""`memra-pp bench`'s measurement: the steady-state decode window from token arrival times, and a real run."""
import sys
from pathlib import Path

import pytest

import memra_pp
from memra_pp.bench import _decode_window, bench_prompts, format_report, run_bench, token_latencies, warm_tokens
from conftest_models import tiny_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from load import config  # noqa: E402


def test_bench_prompts_spread_their_lengths():
    """--prompt-spread: lengths evenly over prompt_len x [1 - s, 1 + s], both ends reached; 0: all prompt_len."""
    import random
    ps = bench_prompts(random.Random(0), 400, 100, 0.5, 50)
    lens = {len(p) for p in ps}
    assert min(lens) == 50 and max(lens) == 150 and len(lens) > 50
    assert all(4 <= t < 50 for p in ps for t in p)
    assert {len(p) for p in bench_prompts(random.Random(0), 5, 16, 0.0, 50)} == {16}
    assert {len(p) for p in bench_prompts(random.Random(0), 50, 2, 1.0, 50)} == {1, 2, 3, 4}


def test_bench_prompts_hold_no_image_placeholders():
    """A vision model's intake refuses a text prompt holding its image or video placeholder id: the benchmark's
    random prompts never draw them (seed 0 over the tiny checkpoint's 512 ids drew 300 in a 200-token prompt)."""
    import random
    import types
    from memra_pp.bench import placeholder_ids
    _, path = tiny_checkpoint("dense", False)
    from placement.schema import load_placement
    dep = types.SimpleNamespace(placement=load_placement(config(str(path))), connected=False)
    from memra_pp.deployment import Deployment
    dep.model_config = Deployment.model_config.fget(dep)
    avoid = placeholder_ids(dep)
    assert dep.model_config.image_token_id in avoid and len(avoid) == 2, avoid
    ps = bench_prompts(random.Random(0), 20, 200, 0.0, 512, avoid)
    assert not avoid & {t for p in ps for t in p}
    assert avoid & {t for p in bench_prompts(random.Random(0), 20, 200, 0.0, 512) for t in p}   # without: drawn
    dep.model_config = types.SimpleNamespace(vision=None, image_token_id=7, video_token_id=8)
    assert placeholder_ids(dep) == frozenset()


def test_decode_window_counts_only_while_every_request_decodes():
    # two requests: first tokens at 1.0 and 2.0, one token per 0.5 s, finishing at 5.0 and 6.0
    a = (0.0, [(1.0 + 0.5 * i, 1) for i in range(9)])        # 1.0 .. 5.0
    b = (0.0, [(2.0 + 0.5 * i, 1) for i in range(9)])        # 2.0 .. 6.0
    rate, window = _decode_window([a, b])
    assert window == pytest.approx(3.0)                       # (2.0, 5.0]
    assert rate == pytest.approx(12 / 3.0)                    # 6 tokens each in the window


def test_decode_window_falls_back_when_no_overlap():
    a = (0.0, [(1.0, 1), (2.0, 1)])
    b = (0.0, [(3.0, 1), (4.0, 2)])
    rate, window = _decode_window([a, b])
    assert window == pytest.approx(3.0) and rate == pytest.approx(3 / 3.0)
    assert _decode_window([]) == (0.0, 0.0)


def test_token_latencies_share_a_gap_among_the_tokens_it_carried():
    a = (0.0, [(1.0, 1), (1.1, 1), (1.5, 2), (1.6, 1)])    # gaps 0.1, 0.4 (two tokens), 0.1
    b = (0.0, [(2.0, 3)])                                   # one event: no gap, no time per output token
    r = token_latencies([a, b])
    assert r["tpot_p50_s"] == pytest.approx(0.6 / 4)                    # 0.6 s over the 4 tokens after the first
    assert r["itl_p50_s"] == pytest.approx(0.1) and r["itl_p99_s"] == pytest.approx(0.2)   # nearest rank
    assert r["itl_max_s"] == pytest.approx(0.4)                         # the longest wait, not shared
    assert token_latencies([]) == dict.fromkeys(("tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s", "itl_max_s"),
                                                0.0)


def test_run_bench_on_two_cpu_stages(ray_cluster):
    _, path = tiny_checkpoint("dense", False)
    lines = []
    with memra_pp.launch(config(str(path))) as dep:
        r = run_bench(dep, 4, 16, 12, progress=lines.append, every_s=0.01)
    assert r["generated_tokens"] == 4 * 12
    # its progress: both phases reported, the timed run's last line no further than its requests and tokens
    assert any(ln.startswith("  warm-up: ") for ln in lines) and any("timed run: " in ln for ln in lines), lines
    last = [ln for ln in lines if "timed run: " in ln][-1]
    done, of = (int(x) for x in last.split("timed run: ")[1].split(" requests")[0].split("/"))
    assert 0 <= done <= of == 4 and f"of {4 * 12} tokens" in last, last
    assert r["decode_tokens_per_s"] > 0 and r["decode_window_s"] > 0
    assert 0 < r["ttft_p50_s"] <= r["request_latency_p50_s"]
    # every request decoded 11 tokens after its first: a time per output token and gaps between them
    assert 0 < r["tpot_p50_s"] <= r["tpot_p99_s"] and 0 < r["itl_p50_s"] <= r["itl_p99_s"] <= r["itl_max_s"]
    assert r["tpot_p99_s"] * 11 <= r["request_latency_p99_s"] and "inter-token latency p50" in format_report(r)
    assert len(r["stages"]) == 2 and all(s["microbatches"] > 0 for s in r["stages"])
    assert r["stages"][1]["handoffs"] > 0
    # stage 0's sends split into the data path and the header's (the last stage sends nothing downstream)
    assert r["stages"][0]["send_write_us"] > 0 and r["stages"][0]["send_header_us"] > 0
    assert r["stages"][1]["send_write_us"] is None
    assert "steady decode" in format_report(r)
    # the steady window (all four decoding) has its own stats: one busy fraction per stage
    assert r["steady_window_s"] > 0 and len(r["steady_busy"]) == 2 and all(0 < b <= 1 for b in r["steady_busy"])
    assert all(0 < s["host_busy"] <= 1 for s in r["stages"])
    ph = r["stages"][0]["phase_us_per_microbatch"]      # the intake loop says where a step's host time goes
    assert {"schedule", "embed", "model", "tokens"} <= set(ph) and all(v >= 0 for v in ph.values())
    assert {"model", "sample"} <= set(r["stages"][1]["phase_us_per_microbatch"])
    # and per microbatch in the steady window alone (no prefill in it)
    st = r["steady_phase_us"]
    assert len(st) == 2 and "model" in st[0] and "sample" in st[1] and all(v >= 0 for p in st for v in p.values())
    assert "in the steady decode window" in format_report(r)
    # and in the prefill ramp (until every request has its first token), where the prefill steps' host time goes
    assert len(r["ramp_phase_us"]) == 2 and "model" in r["ramp_phase_us"][0] and "sample" in r["ramp_phase_us"][1]
    assert len(r["ramp_microbatches"]) == len(r["ramp_busy"]) == 2, r
    assert all(0 < n <= s["microbatches"] for n, s in zip(r["ramp_microbatches"], r["stages"], strict=True))
    assert all(0 < b <= 1 for b in r["ramp_busy"]) and "in the prefill ramp" in format_report(r)
    assert r["graph_captures_in_run"] == 0          # CPU stages decode eagerly


def test_graph_captures_counts_every_stage_that_captures():
    """run_bench's graph_captures_in_run: the stages' decode-graph captures summed, eager stages counting none."""
    from memra_pp.bench import _graph_captures
    st = [{"decode_graphs": {"captures": 3, "replays": 9, "graphs": []}}, {"decode_graphs": {"off": "eager"}},
          {"decode_graphs": None}, {}, {"decode_graphs": {"captures": 2}}]
    assert _graph_captures(st) == 5


def test_timeline_shows_a_chunked_prefill_moving_down_the_pipeline(ray_cluster, tmp_path):
    """run_bench(timeline=True) must return each stage's microbatch spans of the timed request on one clock: a
    100-token prompt in 16-token chunks is 7 prefill spans on each stage carrying all 100 tokens, chunk k reaches
    stage 1 only after stage 0 finished it, and the one decode step follows on both; plot_timelines draws it."""
    from memra_pp.bench import plot_timelines
    _, path = tiny_checkpoint("dense", False)
    cfg = config(str(path))
    cfg["scheduler"].update(max_context=128, prefill_chunk=16)
    with memra_pp.launch(cfg) as dep:
        r = run_bench(dep, 1, 100, 2, timeline=True)
        plain = dep.stats()["stages"]
    assert all("timeline" not in s for s in plain)       # only on request
    tl = r["timeline"]
    assert 0 < tl["ttft_s"] <= tl["wall_s"] and len(tl["stages"]) == 2
    pre = [[s for s in st if s[0] == "prefill"] for st in tl["stages"]]
    assert [len(p) for p in pre] == [7, 7], tl["stages"]
    assert [sum(s[1] for s in p) for p in pre] == [100, 100]
    for a, b in zip(pre[0], pre[1]):              # [kind, tokens, start, end], seconds from the run's start
        assert a[1] == b[1] and 0 <= a[2] <= a[3] <= b[2] <= b[3], (a, b)
    dec = [[s for s in st if s[0] == "decode"] for st in tl["stages"]]
    assert [len(d) for d in dec] == [1, 1] and dec[0][0][2] >= pre[1][-1][3]
    assert tl["ttft_s"] >= pre[1][-1][3]              # the first token needs the last chunk through stage 1
    png = tmp_path / "t.png"
    plot_timelines([("two CPU stages", tl)], str(png), "test")
    assert png.stat().st_size > 10_000


def test_bench_command_plots_the_timeline(ray_cluster, tmp_path, capsys):
    """`memra-pp bench --timeline PNG` (bench.main): the report, the JSON with each stage's spans, and the plot;
    progress goes to stderr, so that `--json` prints JSON alone."""
    import argparse
    import json
    from memra_pp.bench import main
    _, path = tiny_checkpoint("dense", False)
    png, out = tmp_path / "timeline.png", tmp_path / "r.json"
    args = argparse.Namespace(config=config(str(path)), concurrency=2, prompt_len=8, max_new_tokens=4, json=False,
                              out=str(out), timeline=str(png), prompt_spread=0.5)
    assert main(args) == 0
    cap = capsys.readouterr()       # the progress (and the plot's path) on stderr: stdout is the report alone
    assert "timeline plot" in cap.err and "timeline plot" not in cap.out and png.stat().st_size > 10_000
    rep = json.loads(out.read_text())
    assert rep["prompt_spread"] == 0.5 and 2 * 4 <= rep["prompt_tokens"] <= 2 * 12    # 4-12 tokens a prompt
    tl = rep["timeline"]
    assert len(tl["stages"]) == 2 and all(any(s[0] == "decode" for s in st) for st in tl["stages"])


def test_bench_json_is_stdout_alone_whatever_else_prints_meanwhile(ray_cluster, tmp_path, capsys, monkeypatch):
    """`memra-pp bench --json`: stdout must hold the JSON object alone. What the stages print reached this process's
    stdout first (Ray's log_to_driver copies a worker's stdout here: a GPU stage's graph captures, a slow weights
    load), and json.load of it failed; the command's prints meanwhile now go to stderr (a print here stands in for
    the stage's line, which the stages also write to stderr now)."""
    import json

    import yaml

    import memra_pp.bench as bench
    from memra_pp.cli import main
    _, path = tiny_checkpoint("dense", False)
    yml = tmp_path / "b.yaml"
    yml.write_text(yaml.safe_dump(config(str(path))))
    real = bench.run_bench

    def noisy(*a, **k):
        print("(StageActor pid=1) stage 0 (cuda:0): 10 decode graphs captured in 1.0 s")
        return real(*a, **k)
    monkeypatch.setattr(bench, "run_bench", noisy)
    capsys.readouterr()
    assert main(["bench", str(yml), "--json", "--concurrency", "2", "--prompt-len", "8", "--max-new-tokens", "4"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["concurrency"] == 2, cap.out[:300]
    assert "decode graphs captured" in cap.err


def test_device_spans_stay_precise_an_hour_after_the_anchor():
    """GPU spans are placed through timing events whose offsets are float32 milliseconds: an hour after a fixed
    anchor they would be quantised to 0.25 ms, and back-to-back steps would seem to overlap. Each placed span's end
    event anchors the next, so consecutive 1.1 ms steps an hour in keep their exact gaps (fake events, CPU)."""
    import numpy as np
    from memra_pp.stages.timeline import Timeline, kind_of

    class Ev:
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, other):          # as torch.cuda.Event: float32 milliseconds
            return float(np.float32((other.t - self.t) * 1e3))

    tl = Timeline()
    tl._anchor = (Ev(0.0), 100.0)                 # device time 0 is host time 100 s
    t = 3600.0
    for _ in range(50):
        a, b = Ev(t), Ev(t + 1.1e-3)
        tl.device("decode", 64, a, b, b.t - a.t)
        t += 1.1e-3 + 20e-6                       # a 20 us gap between steps
    sp = tl.since()["spans"]
    assert len(sp) == 50 and abs(sp[0][2] - 3700.0) < 1e-3
    gaps = [y[2] - x[3] for x, y in zip(sp, sp[1:])]
    assert all(abs(g - 20e-6) < 1e-6 for g in gaps), gaps[:5]
    assert tl.since(sp[-1][3] + 1)["spans"] == [] and tl.since()["complete"]
    assert kind_of([1, 1], [5, 9]) == "decode" and kind_of([1, 1], [5, 0]) == "prefill"
    assert kind_of([1, 16], [5, 9]) == "prefill"


def test_a_timeline_that_lost_its_start_says_so():
    """Only the newest spans are kept: a window whose first spans were pushed out is flagged incomplete."""
    from memra_pp.stages.timeline import Timeline
    tl = Timeline(maxlen=3)
    for i in range(5):
        tl.host("decode", 1, float(i), i + 0.5)
    assert tl.dropped == 2
    assert tl.since(0.0) == {"spans": [["decode", 1, float(i), i + 0.5] for i in (2, 3, 4)], "complete": False}
    assert tl.since(3.0)["complete"]            # the window starts after what was dropped


def test_warm_up_lasts_until_the_last_prompt_is_prefilled():
    """256 prompts of 128 tokens in prefill steps of 4,096: 8 steps, so each warm-up request makes 3 + 8 tokens;
    never more than the timed requests make."""
    assert warm_tokens(256, 128, 64, 4096) == 11
    assert warm_tokens(1, 128, 64, 512) == 4
    assert warm_tokens(1024, 512, 256, 4096) == 131
    assert warm_tokens(4, 16, 2, 512) == 2
    # scheduler.prefill_chunk_decoding 512: the first step takes 4,096 prompt tokens, the next 512 each
    assert warm_tokens(64, 128, 256, 4096, 512) == 3 + 1 + 8 and warm_tokens(64, 128, 256, 4096, None) == 5
    assert warm_tokens(4, 16, 64, 512, 8) == 4, "the prompts fit the first step: no held steps"


def test_handoff_split_plot_draws_a_probe_run(tmp_path):
    """handoff_probe.plot_split must draw the committed probe run's per-call split (full checks beside fast), and
    must say False where a run has no split to draw."""
    import json
    from pathlib import Path

    from memra_pp.handoff_probe import plot_split
    run = Path(__file__).parent.parent / "docs/results/gpu_probe_handoff_streams-2026-12-02-s13.json"
    png = tmp_path / "split.png"
    assert plot_split(json.loads(run.read_text()), str(png)) and png.stat().st_size > 10_000
    assert not plot_split({"slots_peer": {}}, str(tmp_path / "none.png")) and not (tmp_path / "none.png").exists()
