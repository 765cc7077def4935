"""The prefill's attention (memra_pp/model/attention.attend_batch) on flash attention alone, at the 27B's heads (24
query heads over 4 KV heads of 256): fresh segments (causal) and continuing ones (start > 0: causal from the lower
right, given as torch's CausalBias) must both run on the flash backend and match the math backend over the explicit
mask; the explicit mask itself must not run on flash (why the bias form: else SDPA falls to a backend that takes
masks, and cuDNN plans each new shape). Needs a CUDA GPU: fails (never skips) without one."""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def test_prefill_attention_runs_on_flash_alone():
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (run it on the GPU machine: pytest -m gpu)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from memra_pp.model.attention import attend_batch
    gen = torch.Generator(device="cuda").manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)
    for start, T, G in ((0, 512, 2), (600, 37, 3), (7168, 1024, 1)):
        q, k, v = r(G, T, 24, 256), r(G, 4, start + T, 256), r(G, 4, start + T, 256)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = attend_batch(q, k, v, start)
        S = start + T
        mask = torch.arange(S, device="cuda")[None, :] <= (start + torch.arange(T, device="cuda"))[:, None]
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.float(), v.float(), attn_mask=mask,
                                                 enable_gqa=True).transpose(1, 2).reshape(G, T, -1)
        d = (o.float() - ref).abs().max().item()
        assert d < 3e-2, (start, T, G, d)
        if start:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError):
                F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True)
