"""Where does the bf16 GPU engine part from transformers? Prefill logits of our slices (fla rule and torch rule)
against transformers in bf16 on the same GPU, and greedy tokens. Diagnostic, prints a table."""
import random
import sys

import torch

sys.path.insert(0, "tests")
from tiny_hf import build  # noqa: E402
from memra_pp.model.batch import StepBatch  # noqa: E402
from memra_pp.model.local import LocalPipeline  # noqa: E402
from memra_pp.model.weights import SafetensorsSource  # noqa: E402

m = build("dense", tied=False, seed=3)
m.save_pretrained("/tmp/diag")
hf = type(m).from_pretrained("/tmp/diag", dtype=torch.bfloat16).cuda().eval()
print("hf attn:", hf.config.text_config._attn_implementation if hasattr(hf.config, "text_config") else "?")
rng = random.Random(0)
prompts = [[rng.randrange(4, 320) for _ in range(n)] for n in (1, 7, 40, 130)]
for backend in ("fla", "torch"):
    lp = LocalPipeline(SafetensorsSource("/tmp/diag"), [(0, 8)], dtype=torch.bfloat16, device="cuda", max_seqs=8)
    if backend == "torch":
        for layer in lp.stages[0].layers:
            if not layer.full:
                layer.mixer.rule = None
    for p in prompts:
        lp.caches = [s.new_cache(8, 1024) for s in lp.stages]
        b = StepBatch([0], [0], [len(p)], StepBatch.text_positions([0], [len(p)]), [True])
        ours = lp.step(b, torch.tensor(p))[0].float()
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([p], device="cuda")).logits[0, -1].float()
        print(f"{backend:6s} prompt {len(p):4d}: max|dlogit| {float((ours - ref).abs().max()):.4f}  "
              f"argmax {int(ours.argmax())} vs {int(ref.argmax())}", flush=True)
