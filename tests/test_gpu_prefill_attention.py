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
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError, match="No available kernel"):
                F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True)


def test_prefill_attention_leaves_cudnn_out():
    """attention.sdpa (attend_batch, attend_decode's fallback, the vision tower) never runs cuDNN's SDPA, which plans
    each new shape (about 100 ms of host time for a new prefill step on an H200), and leaves torch's cuDNN switch
    as it found it, an exception included. The premise, on Hopper: plain SDPA picks cuDNN for the same calls
    (else the check proves nothing there; on another GPU the test still asserts that flash or the
    memory-efficient kernel ran)."""
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (run it on the GPU machine: pytest -m gpu)"
    from torch.profiler import ProfilerActivity, profile

    from memra_pp.model.attention import attend_batch, sdpa
    gen = torch.Generator(device="cuda").manual_seed(1)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)

    def ops(fn):
        """The aten ops and device kernels one call ran (names lowered)."""
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            fn()
            torch.cuda.synchronize()
        return {e.name.lower() for e in p.events()}

    def cudnn(names):
        return any("cudnn" in n for n in names)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    q, k, v = r(3, 24, 300, 256), r(3, 4, 300, 256), r(3, 4, 300, 256)
    vq, vk, vv = r(1, 16, 1024, 72), r(1, 16, 1024, 72), r(1, 16, 1024, 72)      # a vision frame: 16 heads of 72
    assert torch.backends.cuda.cudnn_sdp_enabled()
    for plain, ours in ((lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                         lambda: attend_batch(q.transpose(1, 2), k, v, 0)),
                        (lambda: F.scaled_dot_product_attention(vq, vk, vv), lambda: sdpa(vq, vk, vv))):
        if hopper:
            assert cudnn(ops(plain)), "plain SDPA did not pick cuDNN: the premise of this test no longer holds"
        ran = ops(ours)
        assert not cudnn(ran) and ran & {"aten::_scaled_dot_product_flash_attention",
                                          "aten::_scaled_dot_product_efficient_attention"}, sorted(ran)
    qs = q[:, :, -100:].transpose(1, 2)          # a continuing segment (causal from the lower right)
    assert not cudnn(ops(lambda: attend_batch(qs, k, v, 200)))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(RuntimeError):                                   # q and k of different head sizes
        sdpa(q, k[..., :128], v, is_causal=True, enable_gqa=True)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:        # switched off by the caller (a stage process, at setup): stays off
        sdpa(q, k, v, is_causal=True, enable_gqa=True)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_variable_length_attention_equals_each_segment_alone():
    """attend_varlen (the prefill's fresh segments of several lengths in one call of flash attention's
    variable-length kernel, kernels/prefill.fresh_segments) at the 27B's heads (24 query heads over 4 KV heads of
    256), the value rows a strided view as the merged projection gives them: each segment's rows must be what
    attend_batch gives that segment alone, with no host sync."""
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (run it on the GPU machine: pytest -m gpu)"
    from memra_pp.model.attention import attend_batch, attend_varlen
    gen = torch.Generator(device="cuda").manual_seed(1)
    lens = [1, 37, 512, 64, 300]
    R = sum(lens)
    P = torch.randn(R, 24 * 256 + 2 * 4 * 256, generator=gen, device="cuda").to(torch.bfloat16)
    q = P[:, :24 * 256].view(R, 24, 256)
    k, v = P[:, 24 * 256:28 * 256].view(R, 4, 256), P[:, 28 * 256:].view(R, 4, 256)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o = attend_varlen(q, k, v, cu, lens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert o.shape == (R, 24 * 256)
    at = 0
    for n in lens:
        ref = attend_batch(q[at:at + n][None], k[at:at + n][None].transpose(1, 2), v[at:at + n][None].transpose(1, 2),
                           0)[0]
        d = (o[at:at + n].float() - ref.float()).abs().max().item()
        assert d < 2e-2, (n, d)
        at += n
