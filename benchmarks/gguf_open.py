"""Opening a GGUF with a real-sized vocabulary: gguf-py's GGUFReader (what memra_pp used until the fifty-second
session) against memra_pp's own reader, side by side in one run, and what the driver of a launch then pays for its
config and tokenizer.

The file is llama.cpp's tiny dense fixture with Qwen3.5's vocabulary size: 248,320 tokens (synthetic byte-level BPE
strings, the last 320 unused fillers as the converter writes them), about 248k merges, and token_embd grown to match.

Run: .venv/bin/python benchmarks/gguf_open.py [--file PATH] [--repeat 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VOCAB, REAL = 248_320, 248_000


def fixtures() -> Path:
    here = Path(__file__).resolve().parents[1]
    for root in (here / "shared", here.parent / "shared", Path("/work/shared")):
        if (root / "fixtures" / "qwen35-tiny").is_dir():
            return root / "fixtures" / "qwen35-tiny"
    sys.exit("fixtures/qwen35-tiny not found (the shared folder beside the repository)")


def write(path: Path) -> None:
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = sorted(ByteLevel.alphabet())
    toks, merges, seen, rnd = list(alphabet), [], set(alphabet), random.Random(0)
    while len(toks) < REAL:
        a, b = rnd.choice(toks[:5000]), rnd.choice(alphabet)
        if a + b not in seen:
            seen.add(a + b)
            toks.append(a + b)
            merges.append(f"{a} {b}")
    toks += [f"[PAD{i}]" for i in range(len(toks), VOCAB)]
    src = gguf.GGUFReader(str(fixtures() / "dense_text-s404" / "dense_text-f32.gguf"))
    w = gguf.GGUFWriter(str(path), "qwen35")
    for k, f in src.fields.items():
        if k.startswith(("GGUF.", "general.architecture", "tokenizer.")):
            continue
        vt = f.types[0]
        w.add_key_value(k, f.contents(), vt, f.types[1] if vt == gguf.GGUFValueType.ARRAY else None)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(toks)
    w.add_token_types([1] * REAL + [5] * (VOCAB - REAL))
    w.add_token_merges(merges)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    for t in src.tensors:
        a = np.array(t.data)
        if t.name == "token_embd.weight":
            a = np.concatenate([a, rng.standard_normal((VOCAB - a.shape[0], a.shape[1])).astype(np.float32) * .02])
        w.add_tensor(t.name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, help="a GGUF to open (default: write the real-vocabulary one)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    tmp = None
    if a.file is None:
        tmp = tempfile.TemporaryDirectory(prefix="gguf-open-")
        a.file = Path(tmp.name) / "vocab248k.gguf"
        print(f"writing {a.file} ...", file=sys.stderr, flush=True)
        write(a.file)
    import gguf
    from memra_pp.model import gguf_check
    from memra_pp.model.tokenizer import Tokenizer
    from memra_pp.model.weights import open_weights
    rows = {"gguf-py GGUFReader": [], "memra_pp open (scan)": [], "memra_pp config (open_weights)": [],
            "memra_pp config + tokenizer (a launch's driver)": []}
    for i in range(a.repeat):
        print(f"round {i + 1}/{a.repeat}", file=sys.stderr, flush=True)
        t = time.perf_counter()
        gguf.GGUFReader(str(a.file))
        rows["gguf-py GGUFReader"].append(time.perf_counter() - t)
        gguf_check._OPENED.clear()
        t = time.perf_counter()
        gguf_check.GGUFFile(a.file)
        rows["memra_pp open (scan)"].append(time.perf_counter() - t)
        gguf_check._OPENED.clear()
        t = time.perf_counter()
        open_weights(a.file)
        rows["memra_pp config (open_weights)"].append(time.perf_counter() - t)
        gguf_check._OPENED.clear()
        t = time.perf_counter()
        open_weights(a.file)
        Tokenizer.for_model(a.file)
        rows["memra_pp config + tokenizer (a launch's driver)"].append(time.perf_counter() - t)
    out = {k: statistics.median(v) for k, v in rows.items()}
    base = out["gguf-py GGUFReader"]
    if a.json:
        print(json.dumps({"file": str(a.file), "bytes": a.file.stat().st_size, "median_s": out}))
    else:
        print(f"{a.file} ({a.file.stat().st_size / 2**20:.1f} MiB), median of {a.repeat}:")
        for k, v in out.items():
            print(f"  {k:50s} {v:8.3f} s   {base / v:6.1f}x faster than GGUFReader" if k != "gguf-py GGUFReader"
                  else f"  {k:50s} {v:8.3f} s")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
