"""Tiny random Hugging Face checkpoints built inside the tests (no hub).

`make_model(arch, folder, **overrides)` saves a random-init model of the given architecture with
`save_pretrained` plus a byte-level BPE tokenizer (vocab 320), and returns the folder. Models are
fp32 and deterministic (seeded), small enough that building one takes well under a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tokenizer_fixtures import make_byte_bpe_tokenizer

VOCAB = 320

_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _config(arch: str, **overrides: Any):  # noqa: ANN202
    import transformers

    kw = dict(_BASE)
    if arch in ("MixtralForCausalLM",):
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False)
    if arch == "Qwen2MoeForCausalLM":
        kw.update(shared_expert_intermediate_size=80)
    if arch == "MistralForCausalLM":
        kw.update(sliding_window=None)
    kw.update(overrides)
    cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return cfg_cls(**kw)


def make_model(arch: str, folder: Path, seed: int = 0, random_norms_and_biases: bool = False,
               **overrides: Any) -> Path:
    """`random_norms_and_biases`: norm weights 1 + N(0, 0.1^2) and biases N(0, 0.1^2) instead of
    transformers' init (ones and zeros), so a loader or layer that drops them fails parity."""
    import transformers

    torch.manual_seed(seed)
    cfg = _config(arch, **overrides)
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():
        if random_norms_and_biases:
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.1)
                elif "norm" in name.rsplit(".", 2)[-2]:  # input_layernorm, q_norm, model.norm, ...
                    param.normal_(1.0, 0.1)
        # Random init with std 0.02 gives near-flat logits; scale the head up so argmaxes are decisive
        # and fp32 parity is not a coin flip on near-ties.
        head = model.get_output_embeddings()
        head.weight.mul_(8.0)
    model.save_pretrained(str(folder))
    make_byte_bpe_tokenizer(folder)
    return folder


def find_stop_string(text: str, start: int | None = None, length: int = 2) -> str | None:
    """A stop string for stop-string tests: `length` characters of `text` (no U+FFFD from a token cut
    mid-character, not only whitespace) whose first occurrence is past the start of the text, taken at
    `start` (default: the middle) or the nearest later position, else the nearest earlier one; None
    when the text has none (random byte-level text can be all U+FFFD)."""
    start = len(text) // 2 if start is None else start
    for i in [*range(start, len(text) - length + 1), *range(min(start, len(text)) - 1, 0, -1)]:
        stop = text[i : i + length]
        if len(stop) == length and "\ufffd" not in stop and stop.strip() and text.find(stop) > 0:
            return stop
    return None


def middle_stop_string(text: str, start: int | None = None, length: int = 2) -> str:
    """`find_stop_string`, failing (naming the text) when there is none, so a stop-string check never
    drops out silently."""
    stop = find_stop_string(text, start, length)
    assert stop is not None, f"no {length}-character stop string in {text!r}"
    return stop


def load_hf(folder: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def make_eagle_head(target: Path, folder: Path, method: str = "eagle", seed: int = 1, num_layers: int = 1) -> Path:
    """A random EAGLE-1 / EAGLE-3 head for `target`, saved in the on-disk format vLLM loads
    (a one-layer EAGLE-3 head's layer is `midlayer.`; more layers are `layers.0.`, `layers.1.`, ...)."""
    import json

    from safetensors.torch import save_file

    cfg = json.loads((target / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    def layer(prefix: str, in_features: int) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}self_attn.q_proj.weight": rnd(heads * hd, in_features),
            f"{prefix}self_attn.k_proj.weight": rnd(kv * hd, in_features),
            f"{prefix}self_attn.v_proj.weight": rnd(kv * hd, in_features),
            f"{prefix}self_attn.o_proj.weight": rnd(h, heads * hd),
            f"{prefix}mlp.gate_proj.weight": rnd(inter, h),
            f"{prefix}mlp.up_proj.weight": rnd(inter, h),
            f"{prefix}mlp.down_proj.weight": rnd(h, inter),
        }

    prefix = "midlayer." if method == "eagle3" and num_layers == 1 else "layers.0."
    w = layer(prefix, 2 * h if method == "eagle3" else h)
    w[f"{prefix}post_attention_layernorm.weight"] = torch.ones(h)
    head_cfg = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                     "num_key_value_heads", "rms_norm_eps", "vocab_size", "max_position_embeddings")}
    head_cfg.update(num_hidden_layers=num_layers, model_type="llama", rope_theta=10000.0)
    for i in range(1, num_layers):  # plain pre-norm decoder layers on the residual stream
        w.update(layer(f"layers.{i}.", h))
        w[f"layers.{i}.input_layernorm.weight"] = 1.0 + rnd(h)
        w[f"layers.{i}.post_attention_layernorm.weight"] = 1.0 + rnd(h)
    if method == "eagle3":
        n = cfg["num_hidden_layers"]
        draft_vocab = cfg["vocab_size"] // 2
        kept = torch.arange(draft_vocab) * 2  # every other target token
        w.update({
            "fc.weight": rnd(h, 3 * h),
            f"{prefix}input_layernorm.weight": torch.ones(h),
            f"{prefix}hidden_norm.weight": torch.ones(h),
            "norm.weight": torch.ones(h),
            "lm_head.weight": rnd(draft_vocab, h),
            "d2t": kept - torch.arange(draft_vocab),
            "t2d": torch.zeros(cfg["vocab_size"], dtype=torch.bool).index_fill_(0, kept, True),
        })
        head_cfg.update(architectures=["Eagle3LlamaForCausalLM"], draft_vocab_size=draft_vocab,
                        target_hidden_size=h, eagle_aux_hidden_state_layer_ids=[0, n // 2, n])
    else:
        w["fc.weight"] = rnd(h, 2 * h)
        head_cfg.update(architectures=["EagleLlamaForCausalLM"])
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(head_cfg))
    return folder


def make_agreeing_eagle_pair(folder: Path) -> tuple[Path, Path]:
    """A 1-layer target whose attention output is zeroed (so its next token depends only on the
    current one) and an EAGLE-1 head that computes exactly that function of the token it is fed:
    fc = [I, 0] passes the token embedding through, the head's MLP and norm are the target's, and
    the target's final RMSNorm (weight 1) is a positive rescale that leaves the argmax unchanged."""
    import json

    from safetensors.torch import load_file, save_file

    target = make_model("LlamaForCausalLM", folder / "target", num_hidden_layers=1)
    weights = load_file(str(target / "model.safetensors"))
    weights["model.layers.0.self_attn.o_proj.weight"].zero_()
    save_file(weights, str(target / "model.safetensors"))
    head = make_eagle_head(target, folder / "eagle", "eagle")
    hw = load_file(str(head / "model.safetensors"))
    h = weights["model.embed_tokens.weight"].shape[1]
    hw["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    hw["layers.0.self_attn.o_proj.weight"].zero_()
    for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"):
        hw[f"layers.0.{name}.weight"] = weights[f"model.layers.0.{name}.weight"].clone()
    save_file(hw, str(head / "model.safetensors"))
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"]
    return target, head
