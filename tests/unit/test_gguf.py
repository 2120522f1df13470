"""GGUF checkpoints load directly: config, tokenizer and chat template from the metadata, weights
dequantized and un-permuted (phalanx.gguf_file, phalanx.checkpoint).

Each tiny random model is written to GGUF by the `gguf` package's writer (tests/gguf_fixtures.py)
beside a safetensors twin holding exactly the values the GGUF dequantizes to: loading the GGUF must
give bitwise the twin's logprobs (fp32). Bad files get errors that name the problem.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from phalanx import LLM, SamplingParams
from phalanx.checkpoint import gguf_conversion, resolve_model_path
from phalanx.config import ModelConfig
from phalanx.gguf_file import GGUFError
from tests.gguf_fixtures import CHAT_TEMPLATE, write_gguf
from tests.tiny_models import make_model

PROMPTS = [[5, 9, 33, 100, 7, 250], [17, 4, 4, 4, 200, 11, 12, 13, 14]]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_CACHE", str(tmp_path / "phalanx-cache"))


def _outputs(model: str) -> list[tuple[list[int], list[float]]]:
    llm = LLM(model, dtype="float32", max_model_len=64, num_kv_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]))
    return result


def _model(tmp_path: Path, arch: str, **overrides) -> Path:  # noqa: ANN003
    return make_model(arch, tmp_path / "hf", **overrides)


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [
        ("LlamaForCausalLM", "F32"),
        ("LlamaForCausalLM", "Q4_1"),
        ("LlamaForCausalLM", "Q8_0"),
        ("LlamaForCausalLM", "F16"),
        ("Qwen2ForCausalLM", "Q4_0"),
        ("Qwen2ForCausalLM", "BF16"),
        ("Qwen3ForCausalLM", "Q5_0"),
        ("MistralForCausalLM", "Q5_1"),
    ],
)
def test_gguf_round_trips_to_its_dequantized_twin(tmp_path: Path, arch: str, qtype: str) -> None:
    gguf_path, twin = write_gguf(_model(tmp_path, arch), arch, qtype, tmp_path / "gguf")
    cfg = ModelConfig.from_hf(str(gguf_path), "float32")
    twin_cfg = ModelConfig.from_hf(str(twin), "float32")
    assert cfg.architecture == arch
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size", "rope_theta", "tie_word_embeddings", "attention_bias", "qk_norm"):
        assert getattr(cfg, field) == getattr(twin_cfg, field), field
    assert cfg.rms_norm_eps == pytest.approx(twin_cfg.rms_norm_eps, rel=1e-6)
    got, want = _outputs(str(gguf_path)), _outputs(str(twin))
    assert got == want  # tokens and logprobs, bitwise


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q2_K", "Q3_K", "Q5_K"])
def test_k_quants_round_trip(tmp_path: Path, qtype: str) -> None:
    """K-quant blocks are 256 weights wide: a model whose rows are multiples of 256."""
    hf = _model(tmp_path, "LlamaForCausalLM", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                num_key_value_heads=2)
    gguf_path, twin = write_gguf(hf, "LlamaForCausalLM", qtype, tmp_path / "gguf")
    assert _outputs(str(gguf_path)) == _outputs(str(twin))


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path: Path) -> None:
    hf = _model(tmp_path, "LlamaForCausalLM")
    gguf_path, _ = write_gguf(hf, "LlamaForCausalLM", "Q8_0", tmp_path / "gguf")
    llm = LLM(str(gguf_path), dtype="float32", max_model_len=64, num_kv_blocks=16)
    tok = llm.get_tokenizer()
    assert tok.chat_template == CHAT_TEMPLATE
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(hf))
    text = "Hello world! 你好 🙂 def add(a, b):"
    assert tok(text).input_ids == reference(text).input_ids
    # <|im_end|> is the GGUF's eos: it stops requests (one source of truth with the tokenizer's).
    im_end = reference.convert_tokens_to_ids("<|im_end|>")
    assert im_end in llm.config.model.eos_token_ids
    out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].prompt_token_ids == reference.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=True, add_generation_prompt=True, return_dict=False,
        chat_template=CHAT_TEMPLATE,
    )


def test_folder_with_one_gguf_and_auto_dtype(tmp_path: Path) -> None:
    hf = _model(tmp_path, "Qwen2ForCausalLM")
    gguf_path, _ = write_gguf(hf, "Qwen2ForCausalLM", "Q8_0", tmp_path / "gguf")
    assert resolve_model_path(str(gguf_path.parent)) == str(gguf_path)  # the twin/ subfolder is not a .gguf
    import torch

    assert ModelConfig.from_hf(str(gguf_path)).dtype == torch.bfloat16  # quantized -> bf16
    f32, _ = write_gguf(hf, "Qwen2ForCausalLM", "F32", tmp_path / "gguf32")
    assert ModelConfig.from_hf(str(f32)).dtype == torch.float32  # an all-F32 file stays fp32
    (gguf_path.parent / "second.gguf").write_bytes(gguf_path.read_bytes())
    with pytest.raises(ValueError, match="2 .gguf files"):
        resolve_model_path(str(gguf_path.parent))


def test_conversion_is_cached_and_keyed_by_the_file(tmp_path: Path) -> None:
    hf = _model(tmp_path, "LlamaForCausalLM")
    gguf_path, _ = write_gguf(hf, "LlamaForCausalLM", "Q8_0", tmp_path / "gguf")
    first = gguf_conversion(gguf_path)
    assert gguf_conversion(gguf_path) == first
    assert {p.name for p in first.iterdir()} >= {"config.json", "tokenizer.json", "tokenizer_config.json"}
    write_gguf(hf, "LlamaForCausalLM", "Q4_0", tmp_path / "gguf")  # rewritten in place: a new entry
    assert gguf_conversion(gguf_path) != first


@pytest.mark.parametrize("qtype", ["Q4_1", "BF16", "F16", "Q4_K"])
def test_tensor_index_maps_what_the_reader_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str) -> None:
    """The conversion records where each tensor's data lies; a load maps the tensors from the index
    (the header is not parsed again) to bitwise the reader's weights. A cache without the index (an
    older one) is read through the reader once and gains it."""
    import torch

    from phalanx import gguf_file
    from phalanx.checkpoint import hf_config

    hf = _model(tmp_path, "LlamaForCausalLM", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                num_key_value_heads=2)
    gguf_path, _ = write_gguf(hf, "LlamaForCausalLM", qtype, tmp_path / "gguf")
    index = gguf_conversion(gguf_path) / gguf_file.TENSOR_INDEX
    assert index.is_file()
    cfg = hf_config(gguf_path)
    by_reader = dict(gguf_file.iterate_gguf_weights(gguf_path, cfg))
    with monkeypatch.context() as m:
        m.setattr(gguf_file, "_reader", lambda path: pytest.fail("the header was parsed again"))
        by_index = dict(gguf_file.iterate_gguf_weights(gguf_path, cfg, index))
    assert by_index.keys() == by_reader.keys()
    assert all(torch.equal(by_index[k], by_reader[k]) for k in by_reader)
    for damage in (index.unlink, lambda: index.write_text('{"version": 99}'), lambda: index.write_text("{not json")):
        damage()  # missing (an older cache), from another version, unreadable: parsed again and rewritten
        again = dict(gguf_file.iterate_gguf_weights(gguf_path, cfg, index))
        assert all(torch.equal(again[k], by_reader[k]) for k in by_reader)
        assert json.loads(index.read_text())["version"] == 1


@pytest.mark.parametrize("qtype", ["BF16", "F16", "F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"])
def test_grouped_dequantize_is_the_packages_bit_for_bit(monkeypatch: pytest.MonkeyPatch, qtype: str) -> None:
    """`gguf_file.dequantize` runs the `gguf` package's block arithmetic over groups of rows (not its
    16 rows at a time): the same bits as `gguf.dequantize`, whatever the group size, for 2-D and 3-D
    tensors (MoE experts) and a ragged last group."""
    import gguf
    from gguf import GGMLQuantizationType

    from phalanx import gguf_file
    from tests.gguf_fixtures import encode

    t, cols = GGMLQuantizationType[qtype], 512
    raw, _ = encode(np.random.default_rng(7).standard_normal((3 * 37, cols)).astype(np.float32), qtype,
                    np.random.default_rng(8))
    raw = raw.reshape(3, 37, -1)
    for group_values in (cols, 5 * cols, 1 << 20):  # a row, 5 rows (a ragged last group), everything
        monkeypatch.setattr(gguf_file, "DEQUANT_GROUP_VALUES", group_values)
        for data in (raw, raw[1]):
            ours, theirs = gguf_file.dequantize(data, t), gguf.dequantize(data, t)
            assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape == (*data.shape[:-1], cols)
            assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_a_file_shorter_than_its_index_is_a_clear_error(tmp_path: Path) -> None:
    from phalanx import gguf_file
    from phalanx.checkpoint import hf_config

    gguf_path, _ = write_gguf(_model(tmp_path, "LlamaForCausalLM"), "LlamaForCausalLM", "Q8_0", tmp_path / "gguf")
    index, cfg = gguf_conversion(gguf_path) / gguf_file.TENSOR_INDEX, hf_config(gguf_path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[: gguf_path.stat().st_size - 100])
    with pytest.raises(GGUFError, match="cut.gguf.*past the end of the file.*truncated"):
        list(gguf_file.iterate_gguf_weights(cut, cfg, index))


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path) -> None:
    """llama.cpp stores Llama-3.1 rope scaling as a rope_freqs tensor; it becomes the llama3 config
    and gives the twin's (HF llama3-scaled) outputs."""
    import gguf

    from phalanx.gguf_file import llama3_divisor

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf = _model(tmp_path, "LlamaForCausalLM", rope_scaling=scaling, max_position_embeddings=256, rope_theta=500.0)
    gguf_path, twin = write_gguf(hf, "LlamaForCausalLM", "F32", tmp_path / "gguf")
    # Append rope_freqs (as llama.cpp's converter writes it) and the original context to the metadata.
    reader = gguf.GGUFReader(str(gguf_path))
    head_dim = 16
    freqs = np.array([llama3_divisor(1.0 / 500.0 ** (i / head_dim), scaling) for i in range(0, head_dim, 2)],
                     dtype=np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "scaled.gguf"), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, vtype)
    writer.add_uint32("llama.rope.scaling.original_context_length", 64)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_shape=np.array(t.data).shape, raw_dtype=t.tensor_type)
    writer.add_tensor("rope_freqs.weight", freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = ModelConfig.from_hf(str(tmp_path / "scaled.gguf"), "float32")
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["factor"] == pytest.approx(8.0)
    assert _outputs(str(tmp_path / "scaled.gguf")) == _outputs(str(twin))


# ----------------------------------------------------------------------------------------------
# Bad files


def test_truncated_gguf_is_a_clear_error(tmp_path: Path) -> None:
    hf = _model(tmp_path, "LlamaForCausalLM")
    gguf_path, _ = write_gguf(hf, "LlamaForCausalLM", "Q8_0", tmp_path / "gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[: gguf_path.stat().st_size // 2])
    with pytest.raises(GGUFError, match="cut.gguf"):
        ModelConfig.from_hf(str(cut))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        ModelConfig.from_hf(str(junk))


def test_tensors_that_disagree_with_the_metadata(tmp_path: Path) -> None:
    """Metadata says 4 heads of 16; the file says 2 layers but its config claims 3 -> missing weights;
    a wrong embedding length -> a shape mismatch naming the tensor."""
    import gguf

    hf = _model(tmp_path, "LlamaForCausalLM")
    gguf_path, _ = write_gguf(hf, "LlamaForCausalLM", "F32", tmp_path / "gguf")
    for key, value, match in (("llama.block_count", 3, "lacks weights"),
                              ("llama.feed_forward_length", 80, "shape mismatch")):
        reader = gguf.GGUFReader(str(gguf_path))
        out = tmp_path / f"bad-{value}.gguf"
        writer = gguf.GGUFWriter(str(out), "llama")
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue
            vtype = field.types[0]
            v = value if field.name == key else field.contents()
            if vtype == gguf.GGUFValueType.ARRAY:
                writer.add_key_value(field.name, v, vtype, sub_type=field.types[-1])
            else:
                writer.add_key_value(field.name, v, vtype)
        for t in reader.tensors:
            writer.add_tensor(t.name, np.array(t.data), raw_shape=np.array(t.data).shape, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ValueError, match=match):
            LLM(str(out), dtype="float32", max_model_len=64, num_kv_blocks=16)


def test_unsupported_architecture_and_quant_type_are_named(tmp_path: Path) -> None:
    import gguf

    out = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(out), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        ModelConfig.from_hf(str(out))

    hf = _model(tmp_path, "LlamaForCausalLM")
    gguf_path, _ = write_gguf(hf, "LlamaForCausalLM", "F32", tmp_path / "gguf")
    reader = gguf.GGUFReader(str(gguf_path))
    q = tmp_path / "i32.gguf"
    writer = gguf.GGUFWriter(str(q), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, field.contents(), vtype)
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name == "blk.0.ffn_up.weight":  # an integer tensor type no dequantizer handles
            writer.add_tensor(t.name, data.astype(np.int32), raw_dtype=gguf.GGMLQuantizationType.I32)
        else:
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"quantization type I32.*supported: .*Q4_1"):
        LLM(str(q), dtype="float32", max_model_len=64, num_kv_blocks=16)


def test_config_json_records_the_source(tmp_path: Path) -> None:
    hf = _model(tmp_path, "Qwen3ForCausalLM")
    gguf_path, _ = write_gguf(hf, "Qwen3ForCausalLM", "Q8_0", tmp_path / "gguf")
    converted = json.loads((gguf_conversion(gguf_path) / "config.json").read_text())
    assert converted["architectures"] == ["Qwen3ForCausalLM"]
    assert converted["gguf"]["architecture"] == "qwen3" and "Q8_0" in converted["gguf"]["tensor_types"]


def test_bf16_rewrite_for_llama_cpp_serves_the_same_numbers(tmp_path: Path) -> None:
    """benchmarks/gguf_to_bf16.py (the bf16 GGUF llama.cpp is benchmarked on): same config, tokenizer
    and chat template, and in bf16 the same tokens and logprobs as the quantized file it came from."""
    from benchmarks.gguf_to_bf16 import convert

    arch = "LlamaForCausalLM"
    quantized, _ = write_gguf(_model(tmp_path, arch), arch, "Q8_0", tmp_path / "gguf")
    bf16 = tmp_path / "bf16.gguf"
    convert(str(quantized), str(bf16))
    from gguf import GGMLQuantizationType, GGUFReader

    types = {t.name: t.tensor_type for t in GGUFReader(str(bf16)).tensors}
    assert types["token_embd.weight"] == GGMLQuantizationType.BF16
    assert types["output_norm.weight"] == GGMLQuantizationType.F32
    a, b = ModelConfig.from_hf(str(quantized), "bfloat16"), ModelConfig.from_hf(str(bf16), "bfloat16")
    assert (a.num_heads, a.num_kv_heads, a.rope_theta, a.vocab_size) == (b.num_heads, b.num_kv_heads, b.rope_theta,
                                                                         b.vocab_size)

    def run(model: Path) -> list[tuple[list[int], list[float]]]:
        llm = LLM(str(model), dtype="bfloat16", max_model_len=64, num_kv_blocks=16)
        assert llm.get_tokenizer().chat_template == CHAT_TEMPLATE
        params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                              o.outputs[0].logprobs, strict=True)])
                for o in outs]

    assert run(bf16) == run(quantized)
