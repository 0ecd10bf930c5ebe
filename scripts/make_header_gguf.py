"""Copy a GGUF's metadata (config and tokenizer) without its tensors: a few MB instead of ~100-250.

    python scripts/make_header_gguf.py SRC.gguf DST.gguf

``LLM(DST, load_format="dummy")`` (and ``bench_throughput.py --load-format dummy``) builds the same model
with random weights from it: the same shapes, kernels and schedule, so the same speed, while the GPU
machine gets one small file instead of a checkpoint split over several calls. The copy has no tensor, so
a model whose GGUF has an untied ``output.weight`` is built tied (SmolLM2 and Gemma 3 are tied anyway).
"""

from __future__ import annotations

import argparse
import sys

import gguf


def write_header_gguf(src: str, dst: str) -> int:
    """Write ``src``'s key/value metadata, and no tensor, to ``dst``; returns the number of keys."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)  # writes general.architecture itself
    n = 0
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the file's own header fields, which the writer makes
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
        n += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src")
    p.add_argument("dst")
    args = p.parse_args(argv)
    n = write_header_gguf(args.src, args.dst)
    print(f"{args.dst}: {n} metadata keys of {args.src}, no tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
