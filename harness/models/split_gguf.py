"""Splitting a GGUF file into parts as llama.cpp's gguf-split does (the metadata in the first
part, the tensors spread over all, named ``<prefix>-0000i-of-0000N.gguf``), with the ``gguf``
package's writer: what large models on the Hugging Face Hub come as."""

from __future__ import annotations

from pathlib import Path

import gguf


def split_gguf(src: Path, prefix: Path, max_tensors: int) -> list[Path]:
    """Write ``src`` as parts of at most ``max_tensors`` tensors; their paths, in order."""
    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    assert arch is not None
    writer = gguf.GGUFWriter(
        prefix.with_suffix(".gguf"), str(arch.contents()), split_max_tensors=max_tensors
    )
    for field in reader.fields.values():
        # The writer adds the architecture and the GGUF.* fields itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    names = writer.format_shard_names(prefix.with_suffix(".gguf"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return names
