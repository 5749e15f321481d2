"""A model's multimodal projector (its ``mmproj`` GGUF), through llama.cpp's libmtmd: loaded
beside the model, it makes a chat's prompt of its text (with a media marker where each image
goes) and its images, and evaluates an image into one sequence of the decoding context.

``prompt`` tokenizes as llama.cpp's server does (``mtmd_tokenize``): text chunks, whose tokens
the shared batch runs as any prompt's, and image chunks (an image, preprocessed), each an
``ImageSpan`` of the prompt. ``evaluate`` runs one image chunk on its task's sequence at its
position (``mtmd_helper_eval_chunk_single``: the projector encodes it, then ``llama_decode``
takes its embeddings), apart from the shared batch, which cannot mix token and embedding rows.
The helper touches no other sequence; its batch must not be larger than the context's.

``mtmd_tokenize`` only reads the projector's settings: it runs on the thread that prepares a
task while the decoding thread evaluates another's image (as in llama.cpp's server).
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import mtmd_cpp as mtmd

from inference.image_spans import ImagePrompt, ImageSpan, image_token, without_first
from structured.reply import InvalidRequest

log = logging.getLogger(__name__)

# libmtmd's enum mtmd_input_chunk_type.
_TEXT, _IMAGE = 0, 1
# ggml's log levels: warnings and errors reach the runner's log, the rest (the loader's
# description of every tensor) only at debug.
_WARN = 3


@llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
def _logged(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    line = text.decode(errors="replace").rstrip()
    if line:
        log.log(logging.WARNING if level in (_WARN, _WARN + 1) else logging.DEBUG, "%s", line)


def projector_on_gpu(offload: Mapping[str, Any]) -> bool:
    """Whether the projector goes on the GPU: where the model's layers do (``Llama``'s
    arguments: some layers offloaded, a GPU left visible)."""
    return int(offload.get("n_gpu_layers", 0)) > 0 and int(offload.get("main_gpu", 0)) >= 0


class _Chunks:
    """A tokenized prompt's chunks, freed once no ``ImageSpan`` refers to one of them."""

    def __init__(self) -> None:
        self.pointer = mtmd.mtmd_input_chunks_init()
        weakref.finalize(self, mtmd.mtmd_input_chunks_free, self.pointer)


@dataclass(frozen=True)
class _Chunk:
    """One image chunk, and the chunks it is one of (kept alive with it)."""

    owner: _Chunks
    pointer: Any


class Projector:
    """The projector ``path`` of the loaded llama.cpp ``model`` (a ``llama_model`` pointer);
    ``RuntimeError`` when it cannot be loaded for that model."""

    def __init__(self, path: Path, model: Any, *, use_gpu: bool, n_threads: int) -> None:
        mtmd.mtmd_helper_log_set(_logged, None)
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = n_threads
        params.print_timings = False
        ctx = mtmd.mtmd_init_from_file(str(path).encode(), model, params)
        if not ctx:
            raise RuntimeError(
                f"llama.cpp could not load the projector {path.name} for this model (made for"
                " another model? its log says why)"
            )
        self._ctx = ctx
        self._free = weakref.finalize(self, mtmd.mtmd_free, ctx)
        if not mtmd.mtmd_support_vision(ctx):
            self.close()
            raise RuntimeError(f"the projector {path.name} reads no images (an audio one?)")
        self.marker = bytes(mtmd.mtmd_default_marker()).decode()

    def close(self) -> None:
        self._free()

    def prompt(self, text: str, images: Sequence[bytes], bos: int) -> ImagePrompt:
        """``text`` (a ``marker`` where each of ``images`` goes, in order) as the model reads
        it. ``InvalidRequest`` for an image llama.cpp cannot decode (its formats: PNG, JPEG,
        GIF, WebP, BMP...)."""
        chunks = _Chunks()
        # An image sent several times is decoded once (its RGB is the memory that counts:
        # 192 MiB for 8192 x 8192), and the job checked their pixels before (bus/stores/images.py).
        decoded: dict[bytes, Any] = {}
        bitmaps = []
        try:
            for i, data in enumerate(images):
                bitmap = decoded.get(data)
                if bitmap is None:
                    buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                    bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(
                        self._ctx, buffer, len(data), False
                    )
                    if not bitmap:
                        raise InvalidRequest(
                            f"llama.cpp could not decode image {i + 1} of the chat"
                        )
                    decoded[data] = bitmap
                bitmaps.append(bitmap)
            encoded = text.encode()
            given = mtmd.mtmd_input_text(encoded, len(encoded), True, True)
            array = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
            status = mtmd.mtmd_tokenize(
                self._ctx, chunks.pointer, ctypes.byref(given), array, len(bitmaps)
            )
        finally:
            for bitmap in decoded.values():  # the chunks hold their own copy of each image
                mtmd.mtmd_bitmap_free(bitmap)
        if status == 1:
            raise InvalidRequest("the chat's image markers and its images do not match")
        if status != 0:
            raise InvalidRequest(f"llama.cpp could not preprocess the chat's images ({status})")
        made = _read(chunks)
        tokens = made.tokens
        # Chat templates write the BOS themselves; tokenizing adds one too (as ``_tokens``).
        return without_first(made) if tokens[:2] == [bos, bos] else made

    def evaluate(self, lctx: Any, image: ImageSpan, seq: int, n_past: int, n_batch: int) -> None:
        """Encode ``image`` and decode its embeddings into sequence ``seq`` of context
        ``lctx`` from position ``n_past``, ``n_batch`` rows a decode at most (no more than the
        context's batch)."""
        chunk = image.chunk
        assert isinstance(chunk, _Chunk)
        new_n_past = llama_cpp.llama_pos(n_past)
        status = mtmd.mtmd_helper_eval_chunk_single(
            self._ctx, lctx, chunk.pointer, n_past, seq, n_batch, False, ctypes.byref(new_n_past)
        )
        if status != 0:
            raise RuntimeError(f"llama.cpp could not evaluate an image ({status})")


def _read(chunks: _Chunks) -> ImagePrompt:
    """The tokens of the text chunks, and an ``ImageSpan`` for each image chunk."""
    tokens: list[int] = []
    spans: list[ImageSpan] = []
    seen: Counter[str] = Counter()
    for i in range(mtmd.mtmd_input_chunks_size(chunks.pointer)):
        chunk = mtmd.mtmd_input_chunks_get(chunks.pointer, i)
        kind = mtmd.mtmd_input_chunk_get_type(chunk)
        if kind == _TEXT:
            n = ctypes.c_size_t()
            text = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            tokens.extend(text[: n.value] if text else [])
            continue
        if kind != _IMAGE:
            raise InvalidRequest("this model reads images, not audio")
        key = bytes(mtmd.mtmd_input_chunk_get_id(chunk) or b"").decode()
        n_tokens = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
        n_pos = int(mtmd.mtmd_input_chunk_get_n_pos(chunk))
        token = image_token(key, seen[key])
        seen[key] += 1
        spans.append(ImageSpan(len(tokens), n_tokens, n_pos, token, _Chunk(chunks, chunk)))
        tokens.extend([token] * n_tokens)
    return ImagePrompt(tokens, tuple(spans))
