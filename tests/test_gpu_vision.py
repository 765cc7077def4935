"""On a GPU in bf16, the vision tower must track transformers' Qwen3_5VisionModel run in bf16 on the same GPU
(same weights, same casts): rows within bf16 rounding of the reference for images and a video."""
import pytest
import torch

from memra_pp.model.config import VisionConfig
from memra_pp.model.vision import VisionTower

pytestmark = pytest.mark.gpu
MID = dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4, patch_size=16, temporal_patch_size=2,
           spatial_merge_size=2, out_hidden_size=512, num_position_embeddings=256)


@pytest.fixture(scope="module")
def pair():
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (it is selected with -m gpu, never skipped)"
    from transformers import Qwen3_5VisionConfig, Qwen3_5VisionModel
    torch.manual_seed(0)
    hf = Qwen3_5VisionModel(Qwen3_5VisionConfig(**MID))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05))
    hf = hf.to("cuda", torch.bfloat16).eval()
    ours = VisionTower(VisionConfig(**MID)).load_hf_state({k: v for k, v in hf.state_dict().items()})
    return hf, ours


@pytest.mark.parametrize("grids", [[(1, 16, 24)], [(1, 8, 8), (2, 12, 16)]], ids=["image", "image+video"])
def test_tower_bf16_tracks_transformers(pair, grids):
    hf, ours = pair
    g = torch.tensor(grids, device="cuda")
    px = torch.randn(int(g.prod(-1).sum()), 3 * 2 * 16 * 16, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        want = hf(px, grid_thw=g).pooler_output.float()
        got = ours(px, g).float()
    rel = float((got - want).norm() / want.norm())
    print(f"{grids}: relative error {rel:.2e}, max abs {float((got - want).abs().max()):.3e}")
    assert got.shape == want.shape
    assert rel < 1e-2, "bf16 rows must agree with transformers' bf16 tower to bf16 rounding"
