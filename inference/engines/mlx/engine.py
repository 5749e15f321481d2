"""The MLX engine (mlx-lm), for models in MLX format: a directory with config.json, safetensors
weights and the Hugging Face tokenizer files.

Besides ``MlxEngine`` (a whole model in one process), this holds the parts that a pipeline's
ranks (``mlx_pipeline``) share with it: the tokenizer side (``MlxText``) and what an engine
answers from it (``MlxTextEngine``), the prompt's prefill chunks and the model loader. How
tokens are picked (sampling, grammars, log-probabilities) is ``mlx_sampling``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from jinja2 import TemplateError
from mlx.nn.layers.base import Module
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_lm.utils import load_tokenizer

from inference.decoding import Decoding, PromptCached, PromptScores, Sink, Token, request_seed
from inference.engines.batch_loop import BatchLoop
from inference.engines.mlx import vocabulary
from inference.engines.mlx.batch import MlxBatchDecoder, SequencePicker, batchable
from inference.engines.mlx.blas import set_threads
from inference.engines.mlx.prompt_cache import PromptCaches
from inference.engines.mlx.sampling import (
    Grammars,
    Picker,
    check_decoding,
)
from inference.engines.mlx.single import PREFILL_STEP, MlxSingleDecoder, prefill_chunks
from inference.engines.mlx.vision import MlxVision, load_vision
from inference.image_markers import placed
from inference.image_spans import ImagePrompt, unreadable
from structured.reply import InvalidRequest

log = logging.getLogger(__name__)

__all__ = ["PREFILL_STEP", "MlxEngine", "MlxText", "MlxTextEngine", "prefill_chunks"]

# Why a model reads no images when its weights hold no vision tower.
_NO_VISION = "its MLX weights hold no vision tower (mlx-vlm's conversions of a vision model do)"


def load_model(model_dir: Path, strict: bool = True) -> tuple[Module, dict[str, Any]]:
    """The model with its weights not yet read (mlx loads safetensors lazily): the caller keeps
    what it needs and evaluates only that. Not ``strict``: weights left out (the safetensors
    files of other ranks' layers) are not missed."""
    model, config = mlx_lm_load_model(model_dir, lazy=True, strict=strict)
    return model, config


def vocab_size(config: dict[str, Any]) -> int:
    """The width of the model's logits; a multimodal model (Gemma 3) may give it in its
    ``text_config`` only."""
    return int(config.get("vocab_size") or (config.get("text_config") or {})["vocab_size"])


def context_length(requested: int, config: dict[str, Any]) -> int:
    trained = config.get("max_position_embeddings")
    return min(requested, trained) if isinstance(trained, int) and trained > 0 else requested


class MlxText:
    """The tokenizer side of a model: prompts to token ids, token ids to bytes, end tokens, and
    the grammars (compiled for this vocabulary, at the first task that has one)."""

    def __init__(self, tokenizer: TokenizerWrapper, model_dir: Path, n_vocab: int) -> None:
        self._tokenizer = tokenizer
        self._end = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self._pieces = _token_bytes(tokenizer, model_dir)
        self._n_vocab = n_vocab
        self._grammars: Grammars | None = None
        # Hugging Face's tokenizer itself (the wrapper's): its settings, and a copy of it that
        # reads special tokens' texts as text.
        self._hf: Any = getattr(tokenizer, "_tokenizer", tokenizer)
        self._literal = vocabulary.LiteralSpecials(self._hf)

    @classmethod
    def load(cls, model_dir: Path, config: dict[str, Any]) -> MlxText:
        eos = config.get("eos_token_id")
        tokenizer: TokenizerWrapper = load_tokenizer(model_dir, eos_token_ids=eos)  # type: ignore[no-untyped-call]
        return cls(tokenizer, model_dir, vocab_size(config))

    @property
    def n_vocab(self) -> int:
        """The width of the model's logits (a vocabulary may have fewer tokens)."""
        return self._n_vocab

    @property
    def chat_template(self) -> str | None:
        template = self._tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        return template if isinstance(template, str) else None

    def chat_tokens(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        text = self.chat_text(messages, tools, template_kwargs, add_generation_prompt)
        # The template writes the BOS token itself.
        return _non_empty(self._tokenizer.encode(text, add_special_tokens=False))

    def chat_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """A chat through the model's chat template, as text."""
        tok = self._tokenizer
        if not tok.has_chat_template:
            raise InvalidRequest("this model has no chat template: send a plain prompt")
        try:
            text = tok.apply_chat_template(  # type: ignore[no-untyped-call]
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except TemplateError as exc:  # e.g. a role the template rejects
            raise InvalidRequest(f"the chat template rejected the messages: {exc}") from exc
        return str(text)

    def text_tokens(self, prompt: str) -> list[int]:
        # A plain prompt gets the tokenizer's BOS, if it has one.
        return _non_empty(self._tokenizer.encode(prompt, add_special_tokens=True))

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        if not parse_special:
            return self._literal.encode(text, add_special)
        return [int(t) for t in self._tokenizer.encode(text, add_special_tokens=add_special)]

    def detokenize(self, tokens: list[int]) -> str:
        return vocabulary.decode(self._hf, len(self._pieces), tokens)

    def vocabulary_text(self, token: int) -> str:
        return vocabulary.spelling(self._hf, len(self._pieces), token)

    def tokenizer_info(self) -> dict[str, Any]:
        return vocabulary.tokenizer_info(self._hf, self.chat_template)

    def piece(self, token: int) -> bytes:
        return self._pieces[token] if 0 <= token < len(self._pieces) else b""

    def spelled(self, token: int) -> bytes:
        piece = self.piece(token)
        if piece or not 0 <= token < len(self._pieces):
            return piece
        name = self._tokenizer.convert_ids_to_tokens(token)
        return name.encode() if isinstance(name, str) else b""

    def is_end(self, token: int) -> bool:
        return token in self._end

    @property
    def ends(self) -> list[int]:
        return sorted(self._end)

    @property
    def grammars(self) -> Grammars:
        """llguidance's view of the vocabulary, and the grammars compiled for it: built at the
        first use (a pass over the whole vocabulary), then kept."""
        if self._grammars is None:
            tok = self._tokenizer
            names: list[str | None] = tok.convert_ids_to_tokens(list(range(len(self._pieces))))
            # Special tokens have no text in the reply, but a grammar sees it (as llama.cpp's);
            # end tokens are llguidance's end of sequence only.
            pieces = [
                b"" if i in self._end else piece or (name or "").encode()
                for i, (piece, name) in enumerate(zip(self._pieces, names, strict=True))
            ]

            def encode(text: str) -> list[int]:
                return [int(t) for t in tok.encode(text, add_special_tokens=False)]

            self._grammars = Grammars(pieces, sorted(self._end), self._n_vocab, encode)
        return self._grammars

    def picker(self, decoding: Decoding, seed: int) -> Picker:
        """A task's picker; raises ``InvalidRequest`` for a decoding it cannot follow."""
        return Picker(decoding, seed, self._n_vocab, lambda: self.grammars)


def _non_empty(tokens: list[int]) -> list[int]:
    if not tokens:
        raise InvalidRequest("the prompt is empty")
    return [int(t) for t in tokens]


def _token_bytes(tokenizer: TokenizerWrapper, model_dir: Path) -> list[bytes]:
    """Each token's bytes. Byte-level BPE vocabularies (GPT-2 style) spell bytes as printable
    characters, so one token can be part of a UTF-8 character: decoding a token alone to
    ``str`` would lose it, the generation's incremental decoder needs the raw bytes.
    SentencePiece vocabularies mark spaces with U+2581 and spell raw bytes ``<0xNN>``. Special
    tokens (end of turn and the like) have no text, as in llama.cpp."""
    decoder: Any = None
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.exists():
        decoder = json.loads(tokenizer_file.read_text(encoding="utf-8")).get("decoder")
    kinds = [decoder] + (decoder.get("decoders", []) if isinstance(decoder, dict) else [])
    types = {d.get("type") for d in kinds if isinstance(d, dict)}
    n = len(tokenizer)
    names: list[str | None] = tokenizer.convert_ids_to_tokens(list(range(n)))
    added = dict(tokenizer.added_tokens_decoder)
    special = set(tokenizer.all_special_ids) | {int(i) for i, t in added.items() if t.special}
    byte_of = _byte_level_alphabet()
    pieces: list[bytes] = []
    for i, name in enumerate(names):
        if i in special or name is None:
            pieces.append(b"")
        elif i in added:
            pieces.append(str(added[i].content).encode())
        elif "ByteLevel" in types:
            pieces.append(
                bytes(byte_of[c] for c in name)
                if all(c in byte_of for c in name)
                else name.encode()
            )
        elif types & {"ByteFallback", "Replace", "Metaspace"}:
            if len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
                pieces.append(bytes([int(name[3:5], 16)]))
            else:
                pieces.append(name.replace("\u2581", " ").encode())
        else:
            pieces.append(str(tokenizer.decode([i])).encode())
    return pieces


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes: printable Latin-1 bytes stand for themselves,
    the others for the characters from U+0100 on, in order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


class MlxTextEngine:
    """What an MLX engine answers from its tokenizer side (``MlxText``, once loaded), and the
    checks of a prompt before it is generated from, for ``MlxEngine`` and a pipeline's
    ``PipelineHead`` alike."""

    def __init__(self, model_dir: Path, *, n_ctx: int, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self._dir = model_dir
        self._requested_ctx = n_ctx
        self._n_ctx = n_ctx
        self.slots = slots  # generations decoded at once
        self._text: MlxText | None = None

    def _load_text(self, config: dict[str, Any]) -> MlxText:
        """The tokenizer side; the context becomes what was asked, within what the model was
        trained for."""
        self._text = MlxText.load(self._dir, config)
        self._n_ctx = context_length(self._requested_ctx, config)
        return self._text

    def check_prompt(self, prompt: list[int]) -> None:
        """Raises ``InvalidRequest`` for a prompt that cannot be generated from."""
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if len(prompt) >= self.n_ctx:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens, the context {self.n_ctx}")

    @property
    def text(self) -> MlxText:
        if self._text is None:
            raise RuntimeError("engine not loaded")
        return self._text

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_vocab(self) -> int:
        return self.text.n_vocab

    @property
    def chat_template(self) -> str | None:
        return self.text.chat_template

    def chat_tokens(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        return self.text.chat_tokens(messages, tools, template_kwargs, add_generation_prompt)

    def text_tokens(self, prompt: str) -> list[int]:
        return self.text.text_tokens(prompt)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.text.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: list[int]) -> str:
        return self.text.detokenize(tokens)

    def vocabulary_text(self, token: int) -> str:
        return self.text.vocabulary_text(token)

    def tokenizer_info(self) -> dict[str, Any]:
        return self.text.tokenizer_info()

    def piece(self, token: int) -> bytes:
        return self.text.piece(token)

    def spelled(self, token: int) -> bytes:
        return self.text.spelled(token)

    def is_end(self, token: int) -> bool:
        return self.text.is_end(token)


class MlxEngine(MlxTextEngine):
    """A whole MLX model in this process, decoding ``slots`` generations at once.

    Every generation goes through one decoding thread (``batch_loop``): with one slot, one
    forward pass per token (``mlx_single``, as mlx-lm's ``generate_step``); with more, mlx-lm's
    ``BatchGenerator`` (``mlx_batch``), which steps them together. A model whose caches mlx-lm
    cannot batch keeps one slot (and says so in the log).
    Either way a prompt starts from the longest prefix of it that the engine's prompt cache
    holds (``mlx_prompt_cache``; not for a prompt that is scored, whose every position is run).

    ``n_threads`` sizes OpenBLAS's threads where it is in use (``blas.py``); mlx's CPU backend
    itself runs a stream's operations on one thread."""

    def __init__(
        self, model_dir: Path, *, n_ctx: int = 2048, slots: int = 1, n_threads: int | None = None
    ) -> None:
        super().__init__(model_dir, n_ctx=n_ctx, slots=slots)
        if n_threads is not None:
            set_threads(n_threads)
        self._model: Module | None = None
        self._decoder: MlxBatchDecoder | MlxSingleDecoder | None = None
        self._vision: MlxVision | None = None  # a vision model's image side (vision.py)
        self._no_vision = _NO_VISION  # why it reads no images, when it reads none
        # Grammars are compiled and copied on the consumers' threads (a bad one is refused by
        # ``generate``), one at a time.
        self._grammar_lock = threading.Lock()

    def load(self) -> None:
        model, config = load_model(self._dir)
        # Evaluated here, in the loading thread: mlx streams are per thread, and an array still
        # lazy could not be evaluated from the thread that generates.
        mx.eval(model.parameters())  # type: ignore[no-untyped-call]
        text = self._load_text(config)
        _ = text.grammars  # built now, not in the first task with a grammar
        self._model = model
        vision, why = load_vision(self._dir, model)
        self._vision, self._no_vision = vision, why or _NO_VISION
        if self.slots > 1 and not batchable(model):
            log.warning(
                "%s: mlx-lm cannot batch this model's cache, it serves one task at a time, not %d",
                self._dir.name,
                self.slots,
            )
            self.slots = 1
        if self.slots > 1:
            self._decoder = MlxBatchDecoder(
                model,
                slots=self.slots,
                n_ctx=self._n_ctx,
                ends=text.ends,
                prefill_step=PREFILL_STEP,
                vision=self._vision,
            )
        else:
            self._decoder = MlxSingleDecoder(model, n_ctx=self._n_ctx, vision=self._vision)

    def close(self) -> None:
        """Stop the decoding thread; generations in flight fail."""
        if self._decoder is not None:
            self._decoder.close()

    @property
    def _kept(self) -> PromptCaches | None:
        """The prompt cache (the decoder's; what a test or benchmark empties)."""
        return None if self._decoder is None else self._decoder.prompt_cache

    @property
    def model(self) -> Module:
        if self._model is None:
            raise RuntimeError("engine not loaded")
        return self._model

    # --- images (vision.py) -------------------------------------------------------------------

    def images_refused(self) -> str | None:
        """Why this engine reads no images; None: it reads them."""
        return None if self._vision is not None else self._no_vision

    def image_chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        add_generation_prompt: bool,
        images: Sequence[bytes],
    ) -> ImagePrompt:
        """A chat whose contents hold image placeholders (``image_markers.py``), the image
        of each given, as the model reads it: its tokens and its images."""
        if self._vision is None:
            raise InvalidRequest(f"this model does not read images: {self._no_vision}")
        text = self.text.chat_text(messages, tools, template_kwargs, add_generation_prompt)
        text, order = placed(text, self._vision.marker)
        return self._vision.prompt(text, [images[i] for i in order])

    # --- generating -----------------------------------------------------------------------------

    def generate(
        self, prompt: list[int], decoding: Decoding
    ) -> Iterator[Token | PromptScores | PromptCached]:
        decoder, make = self._generation(prompt, decoding)
        return decoder.pull(make)

    def submit(self, prompt: list[int], decoding: Decoding, sink: Sink) -> None:
        """Its items into ``sink``, on the decoding thread; what can be refused is refused
        here."""
        decoder, make = self._generation(prompt, decoding)
        decoder.push(make(sink))

    def _generation(
        self, prompt: list[int], decoding: Decoding
    ) -> tuple[BatchLoop[Any], Callable[[Sink], Any]]:
        """The loop, and what makes the generation for a sink; what can be refused is refused
        here."""
        if self._decoder is None:
            raise RuntimeError("engine not loaded")
        self.check_prompt(prompt)
        if decoding.images:
            if self._vision is None:
                raise InvalidRequest(f"this model does not read images: {self._no_vision}")
            why = unreadable(decoding.images, len(prompt), decoding.echo)
            if why is not None:
                raise InvalidRequest(why)
        decoder = self._decoder
        if isinstance(decoder, MlxSingleDecoder):
            picker = self.text.picker(decoding, request_seed(decoding.params))
            return decoder, lambda sink: decoder.run(prompt, decoding, picker, sink)
        make_picker = self._sequence_picker(prompt, decoding)
        return decoder, lambda sink: decoder.sequence(prompt, decoding, make_picker, sink)

    def _sequence_picker(
        self, prompt: list[int], decoding: Decoding
    ) -> Callable[[], SequencePicker]:
        """What makes a batched generation's picker on the decoding thread; what can be refused
        is refused here."""
        n_vocab = self.text.n_vocab
        check_decoding(decoding, n_vocab)
        constraint = None
        if decoding.grammar is not None:
            with self._grammar_lock:
                constraint = self.text.grammars.constraint(decoding.grammar)
            for token in decoding.generated:  # a resumed task's grammar goes on after them
                constraint.accept(token)
        seed = request_seed(decoding.params)
        # The penalties count what was generated, a resumed task's earlier tokens too.
        before = len(prompt) - len(decoding.generated)
        return lambda: SequencePicker(decoding, seed, n_vocab, before, constraint)
