"""A GGUF file's metadata and tensor names, parsed once per file version and kept on disk.

``gguf.GGUFReader`` turns every entry of a vocabulary array into a NumPy view: SmolLM2's 49k tokens and 49k
merges take 2-6 s to parse, Gemma 3's 262k tokens ~12 s, and every process that starts a model pays it (the
front end for the tokenizer, each engine-core process again). What the tokenizer and the config need (the
key/value metadata and the tensor names) is small: it is written as msgpack under the user's cache directory,
keyed by the file's path, size and modification time, and read back in milliseconds. The weights still go
through ``GGUFReader`` (memory-mapped tensors).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pathlib
from typing import Any

import msgspec

log = logging.getLogger(__name__)

_FORMAT = 1  # bump when what is stored changes


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    """``metadata``: field name -> Python value (``GGUF.*`` header fields left out); ``tensor_names``."""

    metadata: dict[str, Any]
    tensor_names: tuple[str, ...]


def cache_dir() -> pathlib.Path:
    """``$JAXKV_CACHE_DIR`` or ``$XDG_CACHE_HOME/jaxkv`` (default ``~/.cache/jaxkv``), ``gguf-headers/``."""
    base = os.environ.get("JAXKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "jaxkv")
    return pathlib.Path(base) / "gguf-headers"


def _parse(path: pathlib.Path) -> GGUFHeader:
    import gguf
    reader = gguf.GGUFReader(path)
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return GGUFHeader(meta, tuple(t.name for t in reader.tensors))


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of the GGUF at ``path``, from the disk cache when this file version was read before.

    Raises:
        FileNotFoundError: ``path`` is not a file.
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file path={str(p)!r} does not exist")
    st = p.stat()
    key = hashlib.sha256(f"{_FORMAT}|{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    entry = cache_dir() / f"{key}.msgpack"
    try:
        data = msgspec.msgpack.decode(entry.read_bytes())
        return GGUFHeader(data["metadata"], tuple(data["tensor_names"]))
    except (OSError, msgspec.DecodeError, KeyError, TypeError):
        pass
    header = _parse(p)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(msgspec.msgpack.encode({"metadata": header.metadata,
                                                "tensor_names": list(header.tensor_names)}))
        os.replace(tmp, entry)  # atomic: a concurrent reader sees the whole entry or none
    except OSError as e:  # a read-only home: parse every time
        log.info("GGUF header cache not written (%s)", e)
    return header
