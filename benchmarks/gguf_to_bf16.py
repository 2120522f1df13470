"""Rewrite a quantized GGUF as a bf16 one for llama.cpp: every 2-D tensor dequantized and stored as
BF16, every 1-D tensor (the norms) as F32, the metadata (config, tokenizer, chat template) copied as
it is. These are the weights phalanx serves from the quantized file in bf16, so llama.cpp and
phalanx compute with the same numbers. (llama.cpp's own `convert_hf_to_gguf.py --outtype bf16` of a
Hugging Face folder gives the same for a checkpoint that has one; this needs only the `gguf` package.)

    python benchmarks/gguf_to_bf16.py ~/.cache/phalanx/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \\
        /tmp/smollm2-bf16.gguf
"""

from __future__ import annotations

import argparse

import numpy as np


def convert(src: str, dst: str) -> None:
    import gguf
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        # The writer sets these itself (the header, the architecture, the alignment).
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        if name == "general.file_type":
            writer.add_key_value(name, int(gguf.LlamaFileType.MOSTLY_BF16), GGUFValueType.UINT32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if x.ndim == 1:
            writer.add_tensor(t.name, x)
        else:
            bf16 = GGMLQuantizationType.BF16
            writer.add_tensor(t.name, gguf.quants.quantize(x, bf16), raw_dtype=bf16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="the quantized .gguf")
    ap.add_argument("dst", help="the bf16 .gguf to write")
    a = ap.parse_args()
    convert(a.src, a.dst)
    print(f"wrote {a.dst}")


if __name__ == "__main__":
    main()
