"""`make_tiny`: writes a tiny random Qwen3.5 checkpoint (config, safetensors, byte-level BPE tokenizer) without
transformers; the embedded default behind `memra-pp demo`. Runs in the driver process."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from .config import FULL, LINEAR

if TYPE_CHECKING:       # torch only where tensors are drawn: reading an existing checkpoint's config needs none
    import torch

VOCAB = 512
# Specials as in the fixtures' tokenizer (shared/fixtures/qwen35-tiny): ids 0..3 first, bytes 4..259,
# merges up to 499, the rest from 500 on. The config's multimodal token ids point at these.
HEAD_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>")
TAIL_SPECIALS = ("<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
                 "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_pad|>")
TAIL_PLAIN = ("<think>", "</think>")
TAIL_START = VOCAB - len(TAIL_SPECIALS) - len(TAIL_PLAIN)
TOKEN_IDS = {t: TAIL_START + i for i, t in enumerate(TAIL_SPECIALS)}
PAD_ID, EOS_ID = 0, 2
# The Qwen2 pre-tokenizer split (what the released Qwen3.5 tokenizer.json carries).
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096, hidden_act="silu",
            attention_bias=False, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True))
DENSE = dict(intermediate_size=128)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(model_type="qwen3_5_vision", depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
              in_channels=3, patch_size=4, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
              num_position_embeddings=16, hidden_act="gelu_pytorch_tanh")

CORPUS = """\
The river runs past the old mill and under the stone bridge before it reaches the sea. In the morning the
water is cold and clear, and the fishermen walk down to the boats with their nets over their shoulders.
They talk about the weather, the price of bread, and the children who have gone away to the city. Some of
them remember the years when the mill still turned and the whole town smelled of flour and warm wood.

A small model can still teach us a great deal. When every weight is random, the numbers that come out of
it mean nothing, but the paths they take through the machine are the same paths that a real model uses.
If the first stage hands the wrong rows to the second stage, or a cache is read before it is written, the
tokens change, and a careful test will notice. That is why we build the tiny model first and the large one
later, and why we check each piece against a reference that was written by someone else.

She opened the window, looked at the garden, and decided that the roses would need water before noon. The
cat followed her into the kitchen, where the kettle was already singing. "Tea or coffee?" she asked, but
nobody answered; the house was quiet except for the clock on the wall, which had been running five minutes
fast for as long as anyone could remember. Outside, a bicycle bell rang twice and then the street was still.

Numbers are words too: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 32, 64, 128, 256, 512, 1024 and 4096. A
program reads them, adds them, and writes them back; a person reads them and thinks of prices, dates, pages
and the time of the next train. The train leaves at 7:45 from platform 3, and the trip takes 2 hours.
"""


def default_layer_types(num_layers: int) -> list[str]:
    """Three linear-attention layers then one full-attention layer, repeated (the released pattern)."""
    return [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(num_layers)]


def tiny_config(*, moe: bool = False, vision: bool = False, tied: bool = False, num_layers: int = 8,
                layer_types: list[str] | None = None) -> dict:
    """The config.json dict, in the released VLM layout (nested text_config; vision_config only with vision)."""
    types = list(layer_types) if layer_types is not None else default_layer_types(num_layers)
    if len(types) != num_layers or any(t not in (LINEAR, FULL) for t in types):
        raise ValueError(f"layer_types {types!r} must list {num_layers} of {LINEAR!r} / {FULL!r}")
    mtype = "qwen3_5_moe" if moe else "qwen3_5"
    text = dict(model_type=mtype + "_text", **TEXT, **(MOE if moe else DENSE), num_hidden_layers=num_layers,
                layer_types=types, tie_word_embeddings=tied)
    # Without a tower the VLM class would build a full-size default one, so a text-only tiny names the
    # text-only class (which reads the model.language_model. prefix too).
    arch = ("Qwen3_5Moe" if moe else "Qwen3_5") + ("ForConditionalGeneration" if vision else "ForCausalLM")
    cfg = dict(architectures=[arch], model_type=mtype, text_config=text, tie_word_embeddings=tied,
               image_token_id=TOKEN_IDS["<|image_pad|>"], video_token_id=TOKEN_IDS["<|video_pad|>"],
               vision_start_token_id=TOKEN_IDS["<|vision_start|>"],
               vision_end_token_id=TOKEN_IDS["<|vision_end|>"], eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if vision:
        cfg["vision_config"] = dict(VISION, out_hidden_size=TEXT["hidden_size"])
    return cfg


class _Init:
    """Draws tensors from one seeded generator, in call order, so the same seed gives the same bytes."""

    def __init__(self, seed: int):
        import torch
        self.torch = torch
        self.g = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return self.torch.randn(*shape, generator=self.g) * std + mean

    def linear(self, out: int, inp: int, gain: float = 0.7) -> torch.Tensor:
        """A matrix whose output keeps O(1) activations: std gain / sqrt(fan_in)."""
        return self.normal(out, inp, std=gain / math.sqrt(inp))

    def uniform(self, *shape: int, lo: float, hi: float) -> torch.Tensor:
        return self.torch.rand(*shape, generator=self.g) * (hi - lo) + lo


def _mlp(init: _Init, p: str, H: int, I: int, out_gain: float) -> dict[str, torch.Tensor]:
    return {p + "gate_proj.weight": init.linear(I, H), p + "up_proj.weight": init.linear(I, H),
            p + "down_proj.weight": init.linear(H, I, out_gain)}


def text_weights(init: _Init, text: dict) -> dict[str, torch.Tensor]:
    """HF-named language-model tensors (prefix model.language_model.); norms are HF's 1 + w convention."""
    H, D = text["hidden_size"], text["head_dim"]
    nh, nkv = text["num_attention_heads"], text["num_key_value_heads"]
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv, K = text["linear_key_head_dim"], text["linear_value_head_dim"], text["linear_conv_kernel_dim"]
    C = 2 * nk * dk + nv * dv
    out_gain = 0.7 / math.sqrt(2)          # residual branches: keeps the stream O(1) over the layers
    P = "model.language_model."
    w = {P + "embed_tokens.weight": init.normal(text["vocab_size"], H, std=0.3)}
    for i, kind in enumerate(text["layer_types"]):
        p = f"{P}layers.{i}."
        w[p + "input_layernorm.weight"] = init.normal(H, std=0.3)
        w[p + "post_attention_layernorm.weight"] = init.normal(H, std=0.3)
        if kind == FULL:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = init.linear(2 * nh * D, H)      # per head [q, gate] rows
            w[a + "k_proj.weight"] = init.linear(nkv * D, H)
            w[a + "v_proj.weight"] = init.linear(nkv * D, H)
            w[a + "o_proj.weight"] = init.linear(H, nh * D, out_gain)
            w[a + "q_norm.weight"] = init.normal(D, std=0.3)
            w[a + "k_norm.weight"] = init.normal(D, std=0.3)
        else:
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = init.linear(C, H)
            w[a + "in_proj_z.weight"] = init.linear(nv * dv, H)
            w[a + "in_proj_b.weight"] = init.linear(nv, H)
            w[a + "in_proj_a.weight"] = init.linear(nv, H)
            w[a + "conv1d.weight"] = init.normal(C, 1, K, std=0.3)
            w[a + "A_log"] = init.uniform(nv, lo=0.5, hi=8.0).log()
            w[a + "dt_bias"] = init.normal(nv, std=0.3, mean=1.0)
            w[a + "norm.weight"] = init.normal(dv, std=0.3, mean=1.0)   # gated norm: plain w, not 1 + w
            w[a + "out_proj.weight"] = init.linear(H, nv * dv, out_gain)
        if "num_experts" in text:
            E, Im, Is = text["num_experts"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
            m = p + "mlp."
            w[m + "gate.weight"] = init.linear(E, H, 1.0)
            for e in range(E):                                          # per expert, as save_pretrained writes
                w.update(_mlp(init, f"{m}experts.{e}.", H, Im, out_gain))
            w.update(_mlp(init, m + "shared_expert.", H, Is, out_gain))
            w[m + "shared_expert_gate.weight"] = init.linear(1, H, 1.0)
        else:
            w.update(_mlp(init, p + "mlp.", H, text["intermediate_size"], out_gain))
    w[P + "norm.weight"] = init.normal(H, std=0.3)
    if not text["tie_word_embeddings"]:
        w["lm_head.weight"] = init.normal(text["vocab_size"], H, std=0.3)
    return w


def vision_weights(init: _Init, vis: dict) -> dict[str, torch.Tensor]:
    """HF-named vision tower tensors (prefix model.visual.); LayerNorms are plain w with a bias."""
    Hv, Iv, p, t = vis["hidden_size"], vis["intermediate_size"], vis["patch_size"], vis["temporal_patch_size"]
    Hm, Ho = Hv * vis["spatial_merge_size"] ** 2, vis["out_hidden_size"]
    P = "model.visual."

    def lin(name, out, inp):
        w[name + ".weight"] = init.linear(out, inp)
        w[name + ".bias"] = init.normal(out, std=0.1)

    def ln(name, n):
        w[name + ".weight"] = init.normal(n, std=0.3, mean=1.0)
        w[name + ".bias"] = init.normal(n, std=0.1)

    w = {P + "patch_embed.proj.weight": init.normal(Hv, vis["in_channels"], t, p, p, std=0.7 / math.sqrt(
        vis["in_channels"] * t * p * p)), P + "patch_embed.proj.bias": init.normal(Hv, std=0.1),
         P + "pos_embed.weight": init.normal(vis["num_position_embeddings"], Hv, std=0.3)}
    for j in range(vis["depth"]):
        b = f"{P}blocks.{j}."
        ln(b + "norm1", Hv)
        ln(b + "norm2", Hv)
        lin(b + "attn.qkv", 3 * Hv, Hv)
        lin(b + "attn.proj", Hv, Hv)
        lin(b + "mlp.linear_fc1", Iv, Hv)
        lin(b + "mlp.linear_fc2", Hv, Iv)
    ln(P + "merger.norm", Hv)
    lin(P + "merger.linear_fc1", Hm, Hm)
    lin(P + "merger.linear_fc2", Ho, Hm)
    return w


def tiny_tokenizer_json() -> str:
    """A byte-level BPE trained on CORPUS to exactly VOCAB ids, with the specials at the fixtures' ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, \
        processors, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=TAIL_START, show_progress=False, special_tokens=list(HEAD_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TAIL_SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAIL_PLAIN])
    # A corpus too small for the merges would shift every special id: refuse rather than write a mismatch.
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id("<|video_pad|>") == TOKEN_IDS["<|video_pad|>"], \
        tok.get_vocab_size()
    return tok.to_str(pretty=True)


def _tokenizer_config() -> dict:
    added = {str(i): dict(content=t, special=True) for i, t in enumerate(HEAD_SPECIALS)}
    added.update({str(TAIL_START + i): dict(content=t, special=t not in TAIL_PLAIN)
                  for i, t in enumerate(TAIL_SPECIALS + TAIL_PLAIN)})
    for v in added.values():
        v.update(lstrip=False, rstrip=False, normalized=False, single_word=False)
    return dict(tokenizer_class="Qwen2Tokenizer", add_bos_token=False, add_prefix_space=False, bos_token=None,
                eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, errors="replace",
                model_max_length=TEXT["max_position_embeddings"], clean_up_tokenization_spaces=False,
                split_special_tokens=False, added_tokens_decoder=added,
                chat_template="{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                              "message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                              "{{ '<|im_start|>assistant\\n' }}{% endif %}")


SEED_FILE = "memra_tiny.json"     # the seed a tiny checkpoint was made with: a reuse with another one is refused


def make_tiny(path: str | Path, *, moe: bool = False, vision: bool = False, seed: int = 0, tied: bool = False,
              num_layers: int = 8, layer_types: list[str] | None = None, overwrite: bool = False) -> Path:
    """Write a tiny random Qwen3.5 checkpoint to `path` and return it; the same arguments give identical bytes.

    A complete checkpoint already at `path` with the same config and seed (memra_tiny.json) is kept unless
    `overwrite`; one with a different config or seed is refused.
    """
    out = Path(path).expanduser()
    cfg = tiny_config(moe=moe, vision=vision, tied=tied, num_layers=num_layers, layer_types=layer_types)
    if (out / "config.json").exists() and not overwrite:
        if (out / "config.json").read_text(encoding="utf-8") != _dumps(cfg):
            raise FileExistsError(f"{out}: holds a different checkpoint; pass overwrite=True to replace it")
        made = out / SEED_FILE        # (a checkpoint from before the seed was recorded was made with seed 0)
        was = json.loads(made.read_text(encoding="utf-8"))["seed"] if made.exists() else 0
        if was != seed:
            raise FileExistsError(f"{out}: holds the seed-{was} checkpoint, not seed {seed}; pass overwrite=True "
                                  f"to replace it")
        return out
    init = _Init(seed)
    tensors = text_weights(init, cfg["text_config"])
    if vision:
        tensors.update(vision_weights(init, cfg["vision_config"]))
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    gen = dict(eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False)
    # config.json last: its presence marks a complete checkpoint.
    files = {"tokenizer.json": tiny_tokenizer_json(), "tokenizer_config.json": _dumps(_tokenizer_config()),
             "generation_config.json": _dumps(gen), SEED_FILE: json.dumps({"seed": seed}), "config.json": _dumps(cfg)}
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    return out


def _dumps(d: dict) -> str:
    return json.dumps(d, indent=2) + "\n"
