"""Images on MLX: a vision model's image side, from mlx-vlm; its language model stays mlx-lm's.

An MLX vision model (mlx-vlm's conversions, such as mlx-community's Gemma 3) is one directory.
mlx-lm loads its language model, leaving the vision weights out; mlx-vlm loads its processor
(an image to pixels, and the image tokens it takes in the prompt) and its vision tower and
projector (pixels to embeddings, spliced at those tokens by the model's own
``get_input_embeddings``). The engine runs a prompt's chunks through mlx-lm's model with those
embeddings in place of the tokens' (``input_embeddings``), so the batch, the prompt cache and
the sampling are the text engine's own; an image's tokens count in the prompt's length.

What is read on which thread: the processor runs where the prompt is made (numpy and PIL
only); the vision tower on the thread that decodes, where the model's arrays live.

Which models: those whose language model mlx-lm runs with the positions mlx-vlm gives an image
(``READS``). Gemma 3 does; a model with M-RoPE (Qwen2-VL and later) counts an image's
positions in two dimensions, which mlx-lm's language models do not, so it reads text here and
its GGUF variant reads images. mlx-vlm is an optional install (Shoal's ``mlx-vision`` extra);
without it a vision model reads text and says why it refuses images.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx.utils import tree_flatten

from inference.image_spans import ImagePrompt, ImageSpan, image_token
from structured.reply import InvalidRequest

log = logging.getLogger(__name__)

# The model types whose images are read here (their language model's positions are the tokens'
# indices, as mlx-lm counts them).
READS = frozenset({"gemma3"})

INSTALL = "pip install mlx-vlm, or Shoal's mlx-vision extra"


def vision_config(model_dir: Path) -> dict[str, Any] | None:
    """The model's config when it holds a vision tower (``vision_config``); None: text only."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config.get("vision_config"), dict) else None


@dataclass(eq=False)
class PromptPixels:
    """What the processor made of one prompt's text and images (numpy arrays: ``input_ids``,
    ``pixel_values`` and whatever else the model's ``get_input_embeddings`` takes), and, once
    the decoding thread has run the vision tower over them, every position's embedding."""

    inputs: dict[str, np.ndarray]
    embedded: mx.array | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ImageRows:
    """An image span's chunk: its prompt's pixels, and where the span starts in them."""

    pixels: PromptPixels
    at: int


class MlxVision:
    """A model's image side: ``prompt`` makes a chat's text and images into tokens and image
    spans; ``embeddings`` gives the embeddings of a stretch of such a prompt, text and image
    rows alike (on the decoding thread)."""

    def __init__(self, vlm: Any, processor: Any, marker: str, image_token_id: int) -> None:
        self._vlm = vlm
        self._processor = processor
        self.marker = marker
        self._image_token_id = image_token_id

    @classmethod
    def load(cls, model_dir: Path, language: Module) -> MlxVision:
        """The image side of the model in ``model_dir``, whose language model ``language``
        (mlx-lm's) is loaded already: the token embeddings are that model's, not a second
        copy. Its weights are evaluated here, on the loading thread."""
        from mlx_vlm.utils import load_model, load_processor

        vlm = load_model(model_dir, lazy=True, strict=False)
        shared = _embed_tokens(language)
        if shared is not None and _embed_tokens(vlm.language_model) is not None:
            vlm.language_model.model.embed_tokens = shared
        # Only what reads images is evaluated: the rest of mlx-vlm's language model stays
        # unread on the disk (mlx loads safetensors lazily).
        weights: list[tuple[str, mx.array]] = tree_flatten(vlm.parameters())  # type: ignore[assignment]
        mx.eval([w for name, w in weights if not name.startswith("language_model.")])
        processor = load_processor(model_dir, False)
        tokenizer = processor.tokenizer
        image_token_id = int(getattr(vlm.config, "image_token_index", None) or -1)
        if image_token_id < 0:
            raise RuntimeError(f"{model_dir.name}: its config names no image token")
        return cls(vlm, processor, _marker(tokenizer), image_token_id)

    def prompt(self, text: str, images: Sequence[bytes]) -> ImagePrompt:
        """A rendered chat whose images stand at ``marker`` (``images[k]`` at the k-th), as
        the model reads it: its tokens (an image's are the same negative id, made from the
        image's digest) and where each image is."""
        pictures = [_picture(data) for data in images]
        try:
            inputs = self._processor(
                text=text,
                images=pictures or None,
                return_tensors="np",
                add_special_tokens=False,  # the chat template writes the BOS itself
            )
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"the images cannot be read for this model: {exc}") from exc
        arrays = {k: np.asarray(v) for k, v in inputs.items()}
        ids = [int(t) for t in arrays["input_ids"][0]]
        runs = _runs(ids, self._image_token_id)
        if len(runs) != len(images):
            raise InvalidRequest(
                f"the prompt reads {len(runs)} images where {len(images)} were sent: a text"
                " that holds the model's own image tokens cannot be read"
            )
        pixels = PromptPixels(arrays)
        spans = []
        tokens = list(ids)
        for (start, end), data in zip(runs, images, strict=True):
            token = image_token(hashlib.sha256(data).hexdigest(), 0)
            tokens[start:end] = [token] * (end - start)
            n = end - start
            spans.append(ImageSpan(start, n, n, token, ImageRows(pixels, start)))
        return ImagePrompt(tokens, tuple(spans))

    def embeddings(
        self, tokens: Sequence[int], spans: Sequence[ImageSpan], start: int, end: int
    ) -> mx.array:
        """The embeddings of ``tokens[start:end]`` (a prompt with ``spans``), one row a
        position, shaped ``(1, end - start, hidden)``: text rows from the token embeddings,
        an image's from its rows. A fresh array: mlx-lm's models scale it in place."""
        pieces: list[mx.array] = []
        index = start
        for span in sorted(spans, key=lambda s: s.start):
            if span.end <= index or span.start >= end:
                continue
            if span.start > index:
                pieces.append(self._text(tokens[index : span.start]))
                index = span.start
            upto = min(span.end, end)
            rows = span.chunk
            assert isinstance(rows, ImageRows)
            embedded = self._embedded(rows.pixels)
            offset = rows.at + index - span.start
            pieces.append(embedded[offset : offset + upto - index])
            index = upto
        if index < end:
            pieces.append(self._text(tokens[index:end]))
        return mx.concatenate(pieces, axis=0)[None]

    def _text(self, tokens: Sequence[int]) -> mx.array:
        ids = mx.array([list(tokens)])
        return self._vlm.get_input_embeddings(input_ids=ids).inputs_embeds[0]  # type: ignore[no-any-return]

    def _embedded(self, pixels: PromptPixels) -> mx.array:
        if pixels.embedded is None:
            arrays = {k: mx.array(v) for k, v in pixels.inputs.items()}
            ids, values = arrays.pop("input_ids"), arrays.pop("pixel_values")
            mask = arrays.pop("attention_mask", None)
            features = self._vlm.get_input_embeddings(ids, values, mask=mask, **arrays)
            embedded = features.inputs_embeds[0]
            mx.eval(embedded)
            pixels.embedded = embedded
            pixels.inputs = {}  # the pixels are read: only the rows are needed now
        return pixels.embedded


def load_vision(model_dir: Path, language: Module) -> tuple[MlxVision | None, str | None]:
    """The model's image side, or why it reads no images (None, None: a text model)."""
    config = vision_config(model_dir)
    if config is None:
        return None, None
    model_type = str(config.get("model_type", ""))
    if model_type not in READS:
        return None, (
            f"Shoal reads images on MLX for {', '.join(sorted(READS))} models, not"
            f" {model_type} (its GGUF variant reads them with llama.cpp)"
        )
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        return None, f"mlx-vlm, which reads images on MLX, is not installed ({INSTALL})"
    return MlxVision.load(model_dir, language), None


def _embed_tokens(model: Any) -> Module | None:
    """The token embedding of a language model laid out as mlx-lm's and mlx-vlm's are
    (``language_model.model.embed_tokens`` or ``model.embed_tokens``)."""
    inner = getattr(model, "language_model", model)
    embed = getattr(getattr(inner, "model", None), "embed_tokens", None)
    return embed if isinstance(embed, Module) else None


def _marker(tokenizer: Any) -> str:
    """What the chat template writes where an image goes (Gemma 3: ``<start_of_image>``): a
    chat with an image rendered against the same chat without it."""

    def rendered(content: list[dict[str, str]]) -> str:
        chat = [{"role": "user", "content": content}]
        return str(tokenizer.apply_chat_template(chat, tokenize=False))

    text = [{"type": "text", "text": "\x00"}]
    plain, seeing = rendered(text), rendered([{"type": "image"}, *text])
    head = plain.index("\x00")
    if seeing[:head] != plain[:head] or not seeing.endswith(plain[head:]):
        raise RuntimeError("the chat template writes no image marker before a text")
    marker = seeing[head : head + len(seeing) - len(plain)]
    if not marker:
        raise RuntimeError("the chat template writes nothing for an image")
    return marker


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """Where ``token`` stands in ``ids``: each run's start and end."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate([*ids, None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _picture(data: bytes) -> Any:
    """An image's bytes as a PIL image in RGB (a GIF's first frame)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.seek(0)
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise InvalidRequest(f"an image cannot be read: {exc}") from exc


def text_ids(tokens: Sequence[int]) -> list[int]:
    """A chunk's tokens as the model is given them beside its embeddings: an image's (negative)
    ids as 0, which the model does not read when it is given the embeddings."""
    return [max(t, 0) for t in tokens]
