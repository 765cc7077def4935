"""`memra-pp battery CONFIG`: the residency battery over a live placement (driver side). Each row says what it
exercised, its outcome, and its non-vacuity evidence (counters that moved, hashes compared). Variants of the
placement (overlay_publish never/force, transport peer/host, one stage) are launched as the checks need them.
"""
from __future__ import annotations

import copy
import datetime
import json
import sys
import time

import torch

from .errors import ResidencyError
from .placement.schema import load_placement
from .rayutil import get

PROMPTS = [[5, 17, 42, 7, 23, 99], list(range(30, 100)), [11]]
NEW = 12
# image logprobs against a same-context run, by the model's dtype: rows that arrive bit-exact move them not at all
# in float32; in 16 bits another process's kernels (fla's autotuned block sizes, picked by timing) may sum in another
# order, so only a real difference counts there (a zeroed or shifted row moves them by far more, and the tokens)
LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}


def rows_arrived(digests: dict, publishes: bool) -> str | None:
    """None when the image rows the intake spliced are bit-identical to the rows the tower published (once, or not
    at all when nothing `publishes`); else what differs."""
    pub, spliced = digests["published"], sorted(set(digests["spliced"]))
    if not spliced:
        return "the intake spliced no image rows"
    if not publishes:
        return f"{len(pub)} publication(s) recorded where the rows are aliased" if pub else None
    if len(pub) != 1:
        return f"the tower recorded {len(pub)} publications of the image rows, not 1"
    if spliced != pub:
        return (f"the rows the intake spliced (sha256 {', '.join(d[:16] for d in spliced)}) differ from the rows the "
                f"tower published (sha256 {pub[0][:16]})")
    return None


def same_result(r, ref, tol: float) -> str | None:
    """None when `r` has `ref`'s tokens and logprobs (within `tol`); else what differs."""
    if r.token_ids != ref.token_ids:
        return f"tokens {r.token_ids} differ from the reference's {ref.token_ids}"
    diff = max((abs(a - b) for a, b in zip(r.logprobs, ref.logprobs)), default=0.0)
    if len(r.logprobs) != len(ref.logprobs) or not diff <= tol:
        return f"logprobs differ from the reference's by up to {diff:.3g} (tolerance {tol:g})"
    return None


def verdict(rows: list[dict]) -> bool:
    """A report passes when no row FAILs and at least one PASSes (all SKIP shows nothing)."""
    return all(r["outcome"] != "FAIL" for r in rows) and any(r["outcome"] == "PASS" for r in rows)


class Battery:
    def __init__(self, config, progress=print, out: str | None = None):
        self.base = load_placement(config).to_dict()
        # the base run is AUTO's (its rows say so and later checks compare with its tokens); never and force are
        # launched as variants of their own. A YAML naming another mode mislabelled every image row.
        self.given_publish = self.base.get("overlay_publish", "auto")
        self.base["overlay_publish"] = "auto"
        self.rows: list[dict] = []
        self.say = progress
        self.out = out          # rewritten after every row: a run cut short still leaves its evidence
        self.tol = LOGPROB_TOL[self.base["model"]["dtype"]]

    def row(self, check: str, exercised: str, ok: bool | None, evidence: dict) -> None:
        """ok None: the check does not apply to this placement (SKIP, never counted as a pass)."""
        outcome = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        self.rows.append({"check": check, "exercised": exercised, "outcome": outcome, "evidence": evidence})
        self.say(f"  {outcome}  {check}: {exercised}")
        if outcome == "FAIL":   # why, where it is read (without --json the report would not say)
            self.say(f"        evidence: {json.dumps(evidence, default=str)}")
        if self.out:
            with open(self.out, "w") as f:
                json.dump({"config": self.base, "partial": True, "rows": self.rows}, f, indent=1, default=str)

    def variant(self, **over) -> dict:
        d = copy.deepcopy(self.base)
        for k, v in over.items():
            d[k] = v
        d["name"] = f"{d.get('name', 'battery')}-{int(time.time() * 1000) % 10**8}"
        return d

    # -- the checks -------------------------------------------------------------------------------------------
    def run(self) -> dict:
        import memra_pp
        t0 = time.time()
        with memra_pp.launch(self.base) as dep:
            self.say(f"battery on {self.base['name']}: {len(dep.plan.stages)} stage(s), "
                     + ", ".join(f"{s.device}" for s in dep.plan.stages))
            if self.given_publish != "auto":
                self.say(f"  (the YAML's overlay_publish: {self.given_publish} is set aside: the base run is auto's; "
                         "never and force are checked as deployments of their own)")
            self.contexts(dep)
            a0 = dep.stage_actor(0)
            sec = get(a0.run_check.remote("secondary"), 300, "secondary context check")
            if sec.get("applicable"):
                fixes = {"construct": "publish them", "splice": "publish them",
                         "publish_source": "must produce its rows on its own engine",
                         "token_overlay": "load them on the host", "splice_target": "embed in the engine's own"}
                doors = tuple(fixes)
                msgs = {sec[k] for k in doors}
                # each message names the foreign context and its fix (law 4); each door its own message
                named = all(sec["secondary_ctx"] in sec[k] and fix in sec[k] for k, fix in fixes.items())
                ok = sec["differs"] and sec["uid_is_secondary"] and len(msgs) == len(doors) and named \
                    and "NOT REFUSED" not in msgs and sec["splice_wrote_nothing"] and sec["torch_still_works"]
                self.row("secondary_context", "rows allocated by cuCtxCreate on stage 0's device refused at "
                         "construction, splice, publication source and as token overlay rows, and a splice into "
                         "that memory refused (five messages, each naming the context and the fix)", ok,
                         dict(sec, messages_name_context_and_fix=named))
            else:
                self.row("secondary_context", "not applicable: stage 0 is not a CUDA device (no second context "
                         "to create on it)", None, sec)
            pub = get(a0.run_check.remote("same_context_publication"), 60, "publication check")
            self.row("same_context_publication", "FORCE within one context publishes byte-identically; AUTO "
                     "aliases the rows", pub["auto_aliases"] and pub["auto_published"] == 0 and
                     pub["force_published"] == 1 and pub["force_bytes_identical"] and pub["force_copy"]
                     and pub["force_resident"], pub)
            ref, self.base_run = self.recorded_tokens(dep)
            self.images(dep)
        self.never_and_force()
        self.transports(ref)
        report = {"config": self.base, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  "seconds": round(time.time() - t0, 1), "torch": torch.__version__,
                  "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
                  "passed": verdict(self.rows),
                  "rows": self.rows}
        return report

    def contexts(self, dep) -> None:
        ctxs = get([a.run_check.remote("context") for a in dep.actors], 60, "contexts")
        distinct = len({c["ctx"] for c in ctxs}) == len(ctxs)
        ev = {"stages": [str(c["ctx"]) for c in ctxs]}
        shared_dev = len({c["device"] for c in ctxs}) < len(ctxs)
        self.row("contexts", "every stage process has its own context" + (" although stages share a device"
                 if shared_dev else ""), distinct, ev)
        if len(ctxs) > 1:
            f = get(dep.stage_actor(0).run_check.remote("foreign_context", ctxs[1]["ctx"]), 60, "foreign ctx")
            named = foreign_refusals_named(f)
            self.row("foreign_handle", "an overlay carrying stage 1's context (uid value "
                     f"{'equal' if f['same_uid_value'] else 'different'}) is refused in stage 0 at the residency "
                     "check and at the splice, each message naming that context and the fix",
                     f["differ"] and named and f["untouched"], dict(f, messages_name_context_and_fix=named))
        else:
            self.row("foreign_handle", "not applicable: one stage (no other stage's context to carry)", None, {})

    def recorded_tokens(self, dep, at: int = 1):
        """Tokens of PROMPTS, plus (stage `at`'s transport, tokens, sha256 of every activation stage `at` received
        over the boundary before it)."""
        if len(dep.actors) <= at:
            toks = self.tokens(dep)
            return toks, (None, toks, [])
        a = dep.stage_actor(at)
        get(a.run_check.remote("record_rx", True), 30, "record")
        toks = self.tokens(dep)
        hashes = get(a.run_check.remote("record_rx", False), 30, "hashes")
        return toks, (dep.stats()["stages"][at]["transport"], toks, hashes)

    def cuda_boundary(self) -> int | None:
        """The first boundary between two CUDA stages, as the stage that receives over it: the only boundaries whose
        transport is peer or host (a boundary with a CPU side is shared memory). None: there is none."""
        cuda = [str(s.get("device", "cpu")).startswith("cuda") for s in self.base["stages"]]
        return next((i for i in range(1, len(cuda)) if cuda[i - 1] and cuda[i]), None)

    def tokens(self, dep) -> list[list[int]]:
        c = dep.client()
        return [c.generate(p, max_new_tokens=NEW, ignore_eos=True).token_ids for p in PROMPTS]

    def _image_request(self, dep):
        import memra_pp
        mc = dep.model_config
        if mc.vision is None:
            return None
        v = mc.vision
        t, h, w = 1, 2 * v.spatial_merge_size, 3 * v.spatial_merge_size
        g = torch.Generator().manual_seed(7)
        pv = torch.randn(t * h * w, v.in_channels * v.temporal_patch_size * v.patch_size ** 2, generator=g)
        ii = memra_pp.ImageInput(pv, (t, h, w))
        prompt = [5, 17, mc.vision_start_token_id, mc.image_token_id, mc.vision_end_token_id, 42]
        return prompt, [ii]

    def image_run(self, dep):
        """The image request (greedy, with logprobs), and the sha256 of its rows as the stages recorded them:
        {"published": [the tower's, before the dtoh], "spliced": [the intake's, the rows the splice read]}."""
        prompt, imgs = self._image_request(dep)
        get([a.run_check.remote("record_rows", True) for a in dep.actors], 30, "record rows")
        r = dep.client().generate(prompt, images=imgs, max_new_tokens=NEW, ignore_eos=True, logprobs=True)
        recs = get([a.run_check.remote("record_rows", False) for a in dep.actors], 30, "row digests")
        digests = {"published": [], "spliced": []}
        for what, digest in (d for rec in recs for d in rec):
            digests[what].append(digest)
        return r, digests

    @staticmethod
    def _digest_evidence(digests: dict, mismatch: str | None) -> dict:
        return {"published_sha256": [d[:16] for d in digests["published"]],
                "spliced_sha256": sorted({d[:16] for d in digests["spliced"]}), "mismatch": mismatch}

    def images(self, dep) -> None:
        if self._image_request(dep) is None:
            self.row("image_publication", "not applicable: the model has no vision tower", None,
                     {"applicable": False})
            return
        before = dep.stats()["stages"][0]["overlay_publications"]
        try:
            r, digests = self.image_run(dep)
        except ResidencyError as e:     # auto must never refuse: this row's FAIL, not a battery that cannot go on
            self.row("image_publication", "AUTO serves the image request", False,
                     {"refused": str(e), "overlay_publish_in_yaml": self.given_publish})
            return
        st = dep.stats()["stages"]
        moved = st[0]["overlay_publications"] - before
        cross = dep.plan.tower_index != dep.plan.intake_index
        mismatch = rows_arrived(digests, cross)
        self.row("image_publication", f"AUTO with the tower on stage {dep.plan.tower_index} and the intake on "
                 f"stage 0: {'publishes (host bounce)' if cross else 'aliases (one context)'}, and the intake "
                 "splices the rows the tower made, bit-exact (sha256)",
                 moved == (1 if cross else 0) and st[0]["splices"] > 0 and len(r.token_ids) == NEW
                 and mismatch is None,
                 {"publications_moved": moved, "splices": st[0]["splices"], "tokens": r.token_ids,
                  **self._digest_evidence(digests, mismatch)})
        self.image_result = r
        self.image_crosses = cross

    NEVER_FORCE = ("never_refuses", "never_within_context", "force_publishes")

    def never_and_force(self) -> None:
        import memra_pp
        if not hasattr(self, "image_result"):
            for check in self.NEVER_FORCE:
                self.row(check, "not applicable: the model has no vision tower (no image overlay)", None, {})
            return
        if self.image_crosses:
            with memra_pp.launch(self.variant(overlay_publish="never")) as dep:
                prompt, imgs = self._image_request(dep)
                try:
                    dep.client().generate(prompt, images=imgs, max_new_tokens=NEW)
                    refused = "NOT REFUSED"
                except ResidencyError as e:
                    refused = str(e)
                still = self.tokens(dep)
                moved = dep.stats()["stages"][0]["overlay_publications"]
                # the refusal this check claims is never's own, before any row moved (not some other residency
                # refusal of the same type further down the path)
                self.row("never_refuses", "overlay_publish: never across contexts refuses the request with "
                         "ResidencyError before publishing; the deployment keeps serving",
                         "overlay_publish: never, but" in refused and moved == 0 and all(still),
                         {"message": refused, "publications": moved, "served_after": [len(t) for t in still]})
            self.row("never_within_context", "not applicable: the image crosses a context (never_refuses covers "
                     "never)", None, {})
        else:
            # The tower shares the intake's engine: no image row crosses a context, so `never` has nothing to
            # refuse. What must hold instead: the request is served, spliced, with the auto tokens, unpublished.
            self.row("never_refuses", "not applicable: the tower runs on the intake engine (no image crosses a "
                     "context)", None, {})
            with memra_pp.launch(self.variant(overlay_publish="never")) as dep:
                prompt, imgs = self._image_request(dep)
                try:
                    toks, refused = dep.client().generate(prompt, images=imgs, max_new_tokens=NEW,
                                                          ignore_eos=True).token_ids, None
                except ResidencyError as e:     # a refusal here is this check's FAIL, not a battery that cannot run
                    toks, refused = [], str(e)
                st = dep.stats()["stages"][0]
                moved, splices = st["overlay_publications"], st["splices"]
                auto_tokens = self.image_result.token_ids
                self.row("never_within_context", "overlay_publish: never with the tower on the intake engine "
                         "serves the image request (one context: nothing to refuse) with the auto tokens",
                         refused is None and toks == auto_tokens and moved == 0 and splices > 0,
                         {"publications": moved, "splices": splices, "tokens_equal": toks == auto_tokens,
                          "refused": refused})
        with memra_pp.launch(self.variant(overlay_publish="force")) as dep:
            r, digests = self.image_run(dep)
            moved = dep.stats()["stages"][0]["overlay_publications"]
            mismatch = rows_arrived(digests, True) or same_result(r, self.image_result, self.tol)
            self.row("force_publishes", "overlay_publish: force publishes the rows bit-exact (sha256) and gives "
                     "the tokens and logprobs of auto", moved == 1 and mismatch is None,
                     {"publications": moved, **self._digest_evidence(digests, mismatch)})

    def transports(self, ref) -> None:
        import memra_pp
        stages = self.base["stages"]
        gpu = [s for s in stages if str(s.get("device", "cpu")).startswith("cuda")]
        runs = {}
        if len(stages) < 2:
            for check in ("pipeline_equals_one_stage", "transport_peer", "transport_host",
                          "transports_bit_identical"):
                self.row(check, "not applicable: one stage (no boundary)", None, {})
            return
        image = None
        # one stage is the tower too: a vision.engine of stage:N (N >= 1) names no stage there
        with memra_pp.launch(self.variant(stages=[dict(stages[-1], layers="auto")], vision={"engine": "primary"})) \
                as dep:
            runs["one_stage"] = self.tokens(dep)
            if hasattr(self, "image_result"):   # one stage: the tower's rows are the intake's own (same context)
                image = same_result(self.image_result, self.image_run(dep)[0], self.tol)
        crossed = len(self.base_run[2])     # microbatches stage 1 received over the boundary (law 3: it ran)
        self.row("pipeline_equals_one_stage", f"{len(stages)} stages give the tokens of one stage"
                 + (" (and the image request its tokens and logprobs)" if hasattr(self, "image_result") else ""),
                 ref == runs["one_stage"] and crossed > 0 and image is None,
                 {"tokens_equal": ref == runs["one_stage"], "boundary_microbatches": crossed, "image_mismatch": image})
        at = self.cuda_boundary()
        if at is None:
            for check in ("transport_peer", "transport_host", "transports_bit_identical"):
                self.row(check, "not applicable: no boundary between two CUDA stages (a boundary with a CPU side is "
                         "shared memory)", None, {"cuda_stages": len(gpu)})
            return
        hashes, ran = {}, {}
        for kind in ("peer", "host"):
            base_tr, base_toks, base_hashes = self.base_run
            if at == 1 and base_tr == kind:      # the placement under test already runs this transport there
                tr, runs[kind], hashes[kind] = base_tr, base_toks, base_hashes
            else:
                with memra_pp.launch(self.variant(transport=kind)) as dep:
                    (runs[kind], (tr, _, hashes[kind])) = self.recorded_tokens(dep, at)
            ran[kind] = tr == kind and len(hashes[kind]) > 0
            self.row(f"transport_{kind}", f"transport: {kind} (stage {at} receives over {tr}) gives the one-stage "
                     "tokens", ran[kind] and runs[kind] == runs["one_stage"],
                     {"transport": tr, "boundary": at, "microbatches_hashed": len(hashes[kind])})
        # (only where both ran: two runs of one other transport would match too)
        self.row("transports_bit_identical", f"peer and host deliver bit-identical activations (into stage {at})",
                 ran["peer"] and ran["host"] and hashes["peer"] == hashes["host"],
                 {"hashes": len(hashes["peer"]), "equal": hashes["peer"] == hashes["host"], "boundary": at,
                  "transports_ran": ran})


def foreign_refusals_named(f: dict) -> bool:
    """Whether both refusals of the foreign_context check are this refusal: each names the overlay's (foreign)
    context, stage 0's own, and the fix (publish the rows), not some other ResidencyError raised on the way."""
    return all(f["theirs"] in f[k] and f["mine"] in f[k] and "publish them" in f[k]
               for k in ("require_resident", "splice"))


def main(args) -> int:
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print   # --json: stdout is JSON only
    from .bench import check_output_path
    check_output_path("--out", args.out)           # before the launch, not after every check has run
    report = Battery(args.config, progress=say, out=args.out).run()     # (an error: one line, as every command's)
    if args.json:
        print(json.dumps(report, indent=1, default=str), file=getattr(args, "stdout", None), flush=True)
    else:
        failed = [r["check"] for r in report["rows"] if r["outcome"] == "FAIL"]
        why = "" if report["passed"] else f"; FAILED: {', '.join(failed)}" if failed else \
            "; FAILED: no check applies to this placement (nothing was shown)"
        print(f"{sum(r['outcome'] == 'PASS' for r in report['rows'])}/{len(report['rows'])} checks passed "
              f"({sum(r['outcome'] == 'SKIP' for r in report['rows'])} not applicable) "
              f"in {report['seconds']} s{why}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0 if report["passed"] else 1
