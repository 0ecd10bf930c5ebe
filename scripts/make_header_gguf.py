"""Copy a GGUF's metadata (config and tokenizer) without its tensors: a few MB instead of ~100-250.

    python scripts/make_header_gguf.py SRC.gguf DST.gguf [--set KEY=VALUE ...]

``--set`` changes a metadata value (its type stays the source's), e.g. a Llama-3-8B-shaped model from
SmolLM2's header: ``--set llama.block_count=32 llama.embedding_length=4096 llama.feed_forward_length=14336
llama.attention.head_count=32 llama.attention.head_count_kv=8 llama.rope.dimension_count=128
llama.vocab_size=128256`` (the tokenizer stays SmolLM2's; ids past it decode to nothing).

``LLM(DST, load_format="dummy")`` (and ``bench_throughput.py --load-format dummy``) builds the same model
with random weights from it: the same shapes, kernels and schedule, so the same speed, while the GPU
machine gets one small file instead of a checkpoint split over several calls. The copy has no tensor, so
a model whose GGUF has an untied ``output.weight`` is built tied (SmolLM2 and Gemma 3 are tied anyway).
"""

from __future__ import annotations

import argparse
import sys

import gguf


def write_header_gguf(src: str, dst: str, overrides: dict[str, str] | None = None) -> int:
    """Write ``src``'s key/value metadata, and no tensor, to ``dst``; returns the number of keys.

    ``overrides``: ``{key: value text}`` for scalar keys of ``src``, converted to the key's type.

    Raises:
        ValueError: an override names a key ``src`` lacks, or an array key.
    """
    overrides = dict(overrides or {})
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)  # writes general.architecture itself
    n = 0
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the file's own header fields, which the writer makes
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if name in overrides:
            if sub is not None:
                raise ValueError(f"--set {name}: an array value cannot be set")
            text = overrides.pop(name)
            value = text if isinstance(value, str) else type(value)(float(text) if isinstance(value, float) else int(text))
        writer.add_key_value(name, value, vtype, sub_type=sub)
        n += 1
    if overrides:
        raise ValueError(f"--set {sorted(overrides)}: not keys of {src}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="change metadata values")
    args = p.parse_args(argv)
    overrides = dict(kv.split("=", 1) for kv in args.set)
    n = write_header_gguf(args.src, args.dst, overrides)
    print(f"{args.dst}: {n} metadata keys of {args.src}, no tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
