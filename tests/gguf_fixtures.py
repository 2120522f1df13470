"""Tiny GGUF checkpoints written inside the tests by the `gguf` package's writer, each with its
dequantized safetensors twin.

`write_gguf(hf_folder, arch, qtype, out_dir)` turns a tiny random Hugging Face checkpoint (see
``tests.tiny_models``) into ``out_dir/model.gguf`` the way llama.cpp's converter lays files out
(metadata keys, tensor names from gguf's name map, Llama-architecture q/k rows permuted for
llama.cpp's rotary layout, 1-D tensors kept F32, the byte-level BPE tokenizer and a chat template in
the metadata) and writes ``out_dir/twin/``: a safetensors folder holding exactly the values the GGUF
dequantizes to, in Hugging Face layout. A loader that maps, dequantizes and un-permutes correctly
gives bitwise the twin's logits.

Block types the `gguf` package can quantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are
quantized from the model's weights; K-quants (which it only dequantizes) are written as random
blocks with small scales, so the weights are the random blocks' values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# HF model_type -> (GGUF general.architecture, gguf MODEL_ARCH name, general.name)
_ARCH = {
    "LlamaForCausalLM": ("llama", "llama", "tiny-llama"),
    "MistralForCausalLM": ("llama", "llama", "tiny-mistral"),  # llama.cpp writes Mistral as llama
    "Qwen2ForCausalLM": ("qwen2", "qwen2", "tiny-qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3", "tiny-qwen3"),
}
QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# K-quant blocks (256 weights): bytes per block and the byte offsets of their f16 scale fields.
_K_BLOCKS = {
    "Q2_K": (84, (80, 82)),
    "Q3_K": (110, (108,)),
    "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)),
    "Q6_K": (210, (208,)),
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (pairs of rotary halves interleaved per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(raw data to write, the float32 values it dequantizes to)."""
    from gguf import GGMLQuantizationType, quants

    t = GGMLQuantizationType[qtype]
    if qtype in _K_BLOCKS:
        size, scale_offsets = _K_BLOCKS[qtype]
        rows, cols = w.shape
        assert cols % 256 == 0, f"{qtype} needs rows of a multiple of 256 weights, got {cols}"
        raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
        scale = np.frombuffer(np.float16(2e-4).tobytes(), dtype=np.uint8)
        for off in scale_offsets:
            raw[:, :, off : off + 2] = scale
        raw = raw.reshape(rows, -1)
    else:
        raw = quants.quantize(w.astype(np.float32), t)
    return raw, quants.dequantize(raw, t).astype(np.float32).reshape(w.shape)


def write_gguf(hf_folder: Path, arch: str, qtype: str, out_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write ``out_dir/model.gguf`` and its safetensors twin ``out_dir/twin``; returns both paths."""
    import gguf

    raw_arch, map_arch, general_name = _ARCH[arch]
    cfg = json.loads((hf_folder / "config.json").read_text())
    weights = {k: v.float().numpy() for k, v in load_file(str(hf_folder / "model.safetensors")).items()}
    layers = int(cfg["num_hidden_layers"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == map_arch)
    name_map = gguf.get_tensor_name_map(arch_enum, layers)
    rng = np.random.default_rng(seed)

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(str(path), raw_arch)
    writer.add_name(general_name)
    writer.add_block_count(layers)
    writer.add_context_length(int(cfg["max_position_embeddings"]))
    writer.add_embedding_length(int(cfg["hidden_size"]))
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(int(cfg["vocab_size"]))
    _add_tokenizer(writer, hf_folder, int(cfg["vocab_size"]))

    twin: dict[str, torch.Tensor] = {}
    for hf_name, w in weights.items():
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = name_map.get_name(base)
        assert gguf_name is not None, hf_name
        permuted = raw_arch == "llama" and base.endswith(("q_proj", "k_proj"))
        n_head = heads if base.endswith("q_proj") else kv_heads
        data = _permute(w, n_head) if permuted else w
        if w.ndim == 1 or qtype == "F32":
            raw, values = data.astype(np.float32), data.astype(np.float32)
            dtype = gguf.GGMLQuantizationType.F32
        else:
            raw, values = encode(data, qtype, rng)
            dtype = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(f"{gguf_name}.{suffix}", raw, raw_shape=raw.shape, raw_dtype=dtype)
        twin[hf_name] = torch.from_numpy(_unpermute(values, n_head) if permuted else values).contiguous()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    twin_dir = out_dir / "twin"
    twin_dir.mkdir(exist_ok=True)
    save_file(twin, str(twin_dir / "model.safetensors"))
    (twin_dir / "config.json").write_text(json.dumps(cfg))
    for f in hf_folder.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, twin_dir / f.name)
    return path, twin_dir


def _add_tokenizer(writer, hf_folder: Path, vocab_size: int) -> None:  # noqa: ANN001
    """The folder's byte-level BPE as GGUF tokenizer metadata (``tokenizer.ggml.*``)."""
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    tokens = [""] * vocab_size
    types = [1] * vocab_size  # NORMAL
    for text, i in {**vocab, **special}.items():
        tokens[i] = text
    for i in range(vocab_size):
        if not tokens[i]:
            tokens[i], types[i] = f"[PAD{i}]", 5  # UNUSED
    for i in special.values():
        types[i] = 3  # CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(special["<|im_end|>"])
    writer.add_pad_token_id(special["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
