"""GGUF checkpoints (llama.cpp's format): metadata -> a Hugging Face config and tokenizer, tensors ->
Hugging Face-named, dequantized weights.

Owns: `convert_gguf_metadata` (config.json, the tokenizer files and the tensor index written into a
folder, which ``checkpoint.gguf_conversion`` caches), `iterate_gguf_weights` (name, tensor) pairs in
the names ``models.llama.map_hf_name`` reads, and the lists of what is supported.
Does not own: finding files (``checkpoint``), building the model (``models.registry``).

The format is read with the libraries that define it: the `gguf` package parses the file and
dequantizes every block type it knows (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants
Q2_K..Q6_K, and more), transformers' GGUF utilities map the metadata to a config and build the
tokenizer (with the chat template from ``tokenizer.chat_template``), gguf's tensor-name map gives
each Hugging Face name its GGUF name, and transformers' Llama tensor processor undoes the row
permutation that llama.cpp's converter applies to Llama-architecture q/k weights (its rotary
layout). What phalanx adds: the architecture table, the head size of architectures whose config
mapping drops it (Qwen3), Llama-3 rope scaling recognised from the ``rope_freqs`` tensor that
llama.cpp stores in its place, the checkpoint's own float dtype as "auto", errors that name what is
wrong, and the tensor index: where the gguf reader found each tensor's data (`TENSOR_INDEX`, beside
the cached config), so that a later load maps the tensors directly instead of parsing the whole
header again (the reader builds every metadata field, SmolLM2's 49k-token vocabulary and merges
included: ~2.8 s of each load).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# GGUF `general.architecture` (as transformers renames it) -> the Hugging Face architecture phalanx
# serves. llama.cpp writes Mistral models as "llama"; transformers tells them apart by name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# What the name map needs: phalanx architecture -> gguf's MODEL_ARCH name.
_GGUF_ARCH_NAME = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
FLOAT_TYPES = ("F32", "F16", "BF16")
TENSOR_INDEX = "tensors.json"  # in the conversion folder: each tensor's raw data as the reader found it


class GGUFError(ValueError):
    """A GGUF file phalanx cannot serve: corrupt, unsupported, or inconsistent with its metadata."""


def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # truncated / corrupt files fail in numpy's memmap or the header parse
        raise GGUFError(f"{str(path)!r} is not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def convert_gguf_metadata(path: Path, out: Path) -> None:
    """Write config.json and the tokenizer files (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) of GGUF `path` into folder `out`."""
    reader = _reader(path)
    raw_arch = _field(reader, "general.architecture")
    try:
        from transformers import AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as e:
        if "not supported" in str(e):
            raise _unsupported_arch(path, raw_arch) from e
        raise GGUFError(f"{str(path)!r}: its metadata could not be read ({e})") from e
    config: dict[str, Any] = dict(parsed["config"])
    # llama.cpp writes Mistral models as "llama"; only the name tells (transformers' own check compares
    # the name list with "mistral" and misses real names such as "Mistral 7B Instruct").
    if raw_arch == "llama" and "mistral" in str(_field(reader, "general.name") or "").lower():
        config["model_type"] = "mistral"
    model_type = config.get("model_type")
    if model_type not in GGUF_ARCHITECTURES:
        raise _unsupported_arch(path, raw_arch)
    config["architectures"] = [GGUF_ARCHITECTURES[model_type]]
    config.pop("_model_name_or_path", None)
    # transformers' mapping drops the head size for some architectures (Qwen3's is not hidden / heads).
    key_length = _field(reader, f"{raw_arch}.attention.key_length")
    if key_length:
        config["head_dim"] = int(key_length)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    # "auto" dtype: float32 for an all-F32 checkpoint, else bfloat16 (the CPU's fast path; F16 and
    # quantized weights are dequantized into it).
    matrices = [types[t.name] for t in reader.tensors if len(t.shape) > 1]
    config["dtype"] = "float32" if matrices and all(t == "F32" for t in matrices) else "bfloat16"
    if "rope_freqs.weight" in types:
        config["rope_scaling"] = _llama3_scaling(reader, raw_arch, config, path)
    config["gguf"] = {"architecture": raw_arch, "file_type": _field(reader, "general.file_type"),
                      "tensor_types": sorted(set(types.values()))}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    write_tensor_index(reader, out / TENSOR_INDEX)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))


def _unsupported_arch(path: Path, arch: Any) -> GGUFError:
    return GGUFError(
        f"{str(path)!r}: GGUF architecture {arch!r} is not supported; supported: "
        f"{', '.join(sorted(set(_GGUF_ARCH_NAME.values())))} (Llama, Mistral, Qwen2, Qwen3)"
    )


def _llama3_scaling(reader: Any, arch: str, config: dict[str, Any], path: Path) -> dict[str, Any]:
    """llama.cpp stores Llama-3.1-style rope scaling as per-frequency divisors (``rope_freqs``) instead
    of its parameters. Recover the parameters (factor = the largest divisor; low / high frequency
    factors 1 and 4 and the original context of 8192 unless the metadata says otherwise, Meta's
    values) and accept them only if they reproduce the stored divisors."""
    import numpy as np

    tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    stored = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    base = float(config.get("rope_theta") or 10000.0)
    params = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": float(_field(reader, f"{arch}.rope.scaling.low_freq_factor") or 1.0),
        "high_freq_factor": float(_field(reader, f"{arch}.rope.scaling.high_freq_factor") or 4.0),
        "original_max_position_embeddings": int(
            _field(reader, f"{arch}.rope.scaling.original_context_length") or 8192
        ),
    }
    expected = np.array([llama3_divisor(1.0 / base ** (i / head_dim), params) for i in range(0, head_dim, 2)])
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-5, atol=1e-6):
        raise GGUFError(
            f"{str(path)!r}: its rope_freqs tensor does not match Llama-3 rope scaling "
            f"({params}); other per-frequency rope factors are not supported"
        )
    return params


def llama3_divisor(freq: float, p: dict[str, Any]) -> float:
    """The divisor Llama-3 scaling applies to the rotary frequency `freq` (radians per position): 1
    for short wavelengths, `factor` for long ones, a smooth blend between (Meta's reference; the
    same formula as ``layers.rotary``)."""
    wavelen = 2 * math.pi / freq
    old = p["original_max_position_embeddings"]
    low, high, factor = p["low_freq_factor"], p["high_freq_factor"], p["factor"]
    if wavelen < old / high:
        return 1.0
    if wavelen > old / low:
        return factor
    smooth = (old / wavelen - low) / (high - low)
    return 1.0 / ((1 - smooth) / factor + smooth)


def _hf_names(config: dict[str, Any]) -> list[str]:
    """Every Hugging Face tensor name (without .weight / .bias) a dense Llama-family model has."""
    names = ["model.embed_tokens", "model.norm", "lm_head"]
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm", f"{p}.post_attention_layernorm"]
        names += [f"{p}.self_attn.{x}" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [f"{p}.mlp.{x}" for x in ("gate_proj", "up_proj", "down_proj")]
    return names


def gguf_to_hf_names(config: dict[str, Any]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name (suffix included), from gguf's own name map."""
    import gguf

    arch = _GGUF_ARCH_NAME[str(config["model_type"])]
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, int(config["num_hidden_layers"]))
    out: dict[str, str] = {}
    for hf in _hf_names(config):
        g = name_map.get_name(hf)
        if g is not None:
            out[g + ".weight"] = hf + ".weight"
            out[g + ".bias"] = hf + ".bias"
    return out


# Tensors a GGUF may carry that are not weights of the model (rope_freqs is folded into the config).
_NOT_WEIGHTS = ("rope_freqs.weight",)


def write_tensor_index(reader: Any, dest: Path) -> None:
    """`TENSOR_INDEX` for the file `reader` parsed: per tensor its name, GGML type, the byte offset of
    its data and the numpy dtype and shape of the raw array `gguf.dequantize` takes (as the reader
    builds it). Written to a temporary file and renamed into place."""
    entries = [{"name": t.name, "type": t.tensor_type.name, "offset": int(t.data_offset),
                "dtype": t.data.dtype.str, "shape": [int(n) for n in t.data.shape]} for t in reader.tensors]
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")  # ranks loading at once each write their own
    tmp.write_text(json.dumps({"version": 1, "tensors": entries}))
    tmp.replace(dest)


def _indexed_tensors(path: Path, index: Path) -> list[tuple[str, Any, Any]] | None:
    """(name, GGML type, raw data) of every tensor, mapped from the file at the offsets of `index`;
    None when the index cannot be read (the caller parses the file instead)."""
    import numpy as np
    from gguf import GGMLQuantizationType

    try:
        blob = json.loads(index.read_text())
        entries = blob["tensors"] if blob.get("version") == 1 else None
    except (OSError, ValueError, KeyError, AttributeError):
        entries = None
    if entries is None:
        return None
    data = np.memmap(path, mode="r")
    out = []
    for e in entries:
        dtype, shape = np.dtype(e["dtype"]), tuple(e["shape"])
        start, size = int(e["offset"]), math.prod(shape) * dtype.itemsize
        if start + size > data.size:
            raise GGUFError(f"{str(path)!r}: tensor {e['name']!r} ends at byte {start + size}, past the end of "
                            f"the file ({data.size} bytes): the file is truncated")
        out.append((e["name"], GGMLQuantizationType[e["type"]], data[start:start + size].view(dtype).reshape(shape)))
    return out


def iterate_gguf_weights(path: str | Path, config: dict[str, Any],
                         index: Path | None = None) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, float32 torch tensor) for every weight of GGUF `path`, dequantized, q/k
    rows un-permuted for Llama-architecture files. `config` is the converted config.json; `index` its
    folder's tensor index: read instead of parsing the file when it exists, written there when not."""
    import numpy as np
    import torch
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    path = Path(path)
    raw_arch = config.get("gguf", {}).get("architecture")
    tensors = _indexed_tensors(path, index) if index is not None and index.is_file() and raw_arch else None
    if tensors is None:
        reader = _reader(path)
        raw_arch = raw_arch or _field(reader, "general.architecture")
        tensors = [(t.name, t.tensor_type, t.data) for t in reader.tensors]
        if index is not None:
            with contextlib.suppress(OSError):  # a read-only cache: the next load parses the header again
                write_tensor_index(reader, index)
    processor = TENSOR_PROCESSORS.get(raw_arch, TensorProcessor)(config=config)
    names = gguf_to_hf_names(config)
    for name, tensor_type, data in tensors:
        if name in _NOT_WEIGHTS:
            continue
        hf_name = names.get(name)
        if hf_name is None:
            raise GGUFError(f"{str(path)!r}: tensor {name!r} is not part of a {raw_arch} model")
        try:
            weights = dequantize(data, tensor_type)
        except NotImplementedError as e:
            raise GGUFError(
                f"{str(path)!r}: tensor {name!r} has quantization type {tensor_type.name}, "
                f"which cannot be dequantized; supported: {', '.join(supported_quant_types())}"
            ) from e
        except ValueError as e:  # data shorter than the shape says (a truncated file)
            raise GGUFError(f"{str(path)!r}: tensor {name!r} is inconsistent ({e})") from e
        weights = processor.process(weights=weights, name=name).weights
        # copied only where it is not already an array of its own (F32 tensors are views of the
        # read-only file mapping; `dequantize`'s results are fresh arrays)
        yield hf_name, torch.from_numpy(np.require(weights, np.float32, ["C", "W", "O"]))


DEQUANT_GROUP_VALUES = 1 << 20  # values dequantized per call of the block arithmetic


def dequantize(data: Any, qtype: Any) -> Any:
    """`gguf.dequantize(data, qtype)`, bit for bit — the `gguf` package's own block arithmetic
    (its ``dequantize_rows``) — over groups of ~1M values instead of the package's 16 rows at a time.
    Its per-call overhead dominates for a model of short rows: SmolLM2's Q4_1 file (rows of 576)
    dequantizes in ~1.1 s instead of ~3.7 s."""
    import gguf
    import numpy as np
    from gguf.quants import _type_traits  # type: ignore[attr-defined]

    quant = _type_traits.get(qtype)
    if quant is None:  # F32 / F16 (a view / one cast), or a type gguf reports as not implemented
        return gguf.dequantize(data, qtype)
    quant.init_grid()
    rows = data.reshape(-1, data.shape[-1])
    row_values = rows.shape[1] * rows.dtype.itemsize // quant.type_size * quant.block_size
    group = max(1, DEQUANT_GROUP_VALUES // max(row_values, 1))
    parts = [quant.dequantize_rows(rows[i:i + group]) for i in range(0, rows.shape[0], group)]
    return np.concatenate(parts).reshape(*data.shape[:-1], row_values)


def supported_quant_types() -> list[str]:
    """Block types the installed `gguf` package can dequantize."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # type: ignore[attr-defined]

    return sorted(t.name for t in GGMLQuantizationType if t in _type_traits or t.name in FLOAT_TYPES)
