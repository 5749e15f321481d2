"""The MLX engine (mlx-lm), for models in MLX format: a directory with config.json, safetensors
weights and the Hugging Face tokenizer files.

Besides ``MlxEngine`` (a whole model in one process), this holds the parts that a pipeline stage
(``mlx_pipeline``) shares with it: the tokenizer side (``MlxText``), the sampler, the prompt's
prefill chunks and the model loader.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from jinja2 import TemplateError
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_lm.utils import load_tokenizer

from bus.events import SamplingParams, TaskCreated
from services.runner.generation import InvalidRequest

# The prompt but its last token is run through the model in chunks of this many tokens, and
# the last token alone, as mlx-lm's generate_step does (prefill_step_size): a long prompt's
# attention scores stay small, and greedy output is bit for bit mlx-lm's.
PREFILL_STEP = 512


def prefill_chunks(prompt: list[int]) -> list[list[int]]:
    """The prompt in the pieces the model runs: chunks of everything but the last token, then
    the last token (whose logits give the first generated token)."""
    body = prompt[:-1]
    return [body[i : i + PREFILL_STEP] for i in range(0, len(body), PREFILL_STEP)] + [prompt[-1:]]


def load_model(model_dir: Path) -> tuple[Module, dict[str, Any]]:
    """The model with its weights not yet read (mlx loads safetensors lazily): the caller keeps
    what it needs and evaluates only that."""
    model, config = mlx_lm_load_model(model_dir, lazy=True)
    return model, config


def context_length(requested: int, config: dict[str, Any]) -> int:
    trained = config.get("max_position_embeddings")
    return min(requested, trained) if isinstance(trained, int) and trained > 0 else requested


class MlxText:
    """The tokenizer side of a model: prompts to token ids, token ids to bytes, end tokens."""

    def __init__(self, tokenizer: TokenizerWrapper, model_dir: Path) -> None:
        self._tokenizer = tokenizer
        self._end = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self._pieces = _token_bytes(tokenizer, model_dir)

    @classmethod
    def load(cls, model_dir: Path, config: dict[str, Any]) -> MlxText:
        eos = config.get("eos_token_id")
        tokenizer: TokenizerWrapper = load_tokenizer(model_dir, eos_token_ids=eos)  # type: ignore[no-untyped-call]
        return cls(tokenizer, model_dir)

    def prompt_tokens(self, task: TaskCreated) -> list[int]:
        tok = self._tokenizer
        if task.kind == "completion" or task.messages is None:
            if task.prompt is None:
                raise InvalidRequest("a completion task needs a prompt")
            # A plain prompt gets the tokenizer's BOS, if it has one.
            tokens: list[int] = tok.encode(task.prompt, add_special_tokens=True)
        else:
            if not tok.has_chat_template:
                raise InvalidRequest("this model has no chat template: send a plain prompt")
            messages = [m.model_dump(exclude_none=True) for m in task.messages]
            try:
                text = tok.apply_chat_template(  # type: ignore[no-untyped-call]
                    messages, add_generation_prompt=True, tokenize=False
                )
            except TemplateError as exc:  # e.g. a role the template rejects
                raise InvalidRequest(f"the chat template rejected the messages: {exc}") from exc
            # The template writes the BOS token itself.
            tokens = tok.encode(str(text), add_special_tokens=False)
        if not tokens:
            raise InvalidRequest("the prompt is empty")
        return [int(t) for t in tokens]

    def piece(self, token: int) -> bytes:
        return self._pieces[token] if 0 <= token < len(self._pieces) else b""

    def is_end(self, token: int) -> bool:
        return token in self._end


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
            pieces.append(bytes(byte_of[c] for c in name) if all(c in byte_of for c in name)
                          else name.encode())  # fmt: skip
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
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


class Sampler:
    """Picks each next token from a step's logits as the request's SamplingParams say: greedy
    at temperature 0, else from the temperature-scaled distribution cut to top_p, with its own
    random key (the same seed gives the same tokens). Presence and frequency penalties, as
    OpenAI defines them, count the tokens generated so far."""

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self._temperature = params.temperature
        self._top_p = params.top_p
        self._presence = params.presence_penalty
        self._frequency = params.frequency_penalty
        self._key = mx.random.key(seed % 2**64)
        self._counts: dict[int, int] = {}

    def __call__(self, logits: mx.array) -> int:
        """``logits``: the last position's, shape (1, vocab)."""
        if self._counts and (self._presence or self._frequency):
            ids = mx.array(list(self._counts))
            penalty = mx.array(
                [self._presence + self._frequency * c for c in self._counts.values()]
            )
            logits = logits.astype(mx.float32)
            logits[:, ids] = logits[:, ids] - penalty
        # Log-probabilities in the model's dtype, as mlx-lm's samplers take them.
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self._temperature == 0:
            choice = mx.argmax(logprobs, axis=-1)
        else:
            self._key, key = mx.random.split(self._key)
            scaled = logprobs.astype(mx.float32) * (1 / self._temperature)
            if self._top_p < 1.0:
                order = mx.argsort(-scaled, axis=-1)
                ordered = mx.take_along_axis(scaled, order, axis=-1)
                probs = mx.softmax(ordered, axis=-1)
                # The most likely tokens whose probabilities add up to top_p (at least one).
                keep = (mx.cumsum(probs, axis=-1) - probs) < self._top_p
                ordered = mx.where(keep, ordered, -mx.inf)
                picked = mx.random.categorical(ordered, axis=-1, key=key)
                choice = mx.take_along_axis(order, picked[:, None], axis=-1)[:, 0]
            else:
                choice = mx.random.categorical(scaled, axis=-1, key=key)
        token = int(np.array(choice)[0])
        self._counts[token] = self._counts.get(token, 0) + 1
        return token


def resolve_seed(params: SamplingParams) -> int:
    return params.seed if params.seed is not None else int.from_bytes(os.urandom(8))


class MlxEngine:
    """A whole MLX model in this process.

    ``n_threads`` is accepted for the runner's uniform call and ignored: mlx's CPU backend runs
    a stream's operations on one thread, and the mlx[cpu] wheel's bundled BLAS is the
    single-threaded reference one, so there are no threads to size."""

    def __init__(self, model_dir: Path, *, n_ctx: int = 2048, n_threads: int | None = None) -> None:
        self._dir = model_dir
        self._requested_ctx = n_ctx
        self._model: Module | None = None
        self._text: MlxText | None = None
        self._n_ctx = n_ctx

    def load(self) -> None:
        model, config = load_model(self._dir)
        # Evaluated here, in the loading thread: mlx streams are per thread, and an array still
        # lazy could not be evaluated from the thread that generates.
        mx.eval(model.parameters())  # type: ignore[no-untyped-call]
        self._text = MlxText.load(self._dir, config)
        self._n_ctx = context_length(self._requested_ctx, config)
        self._model = model

    @property
    def model(self) -> Module:
        if self._model is None:
            raise RuntimeError("engine not loaded")
        return self._model

    @property
    def text(self) -> MlxText:
        if self._text is None:
            raise RuntimeError("engine not loaded")
        return self._text

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    def prompt_tokens(self, task: TaskCreated) -> list[int]:
        return self.text.prompt_tokens(task)

    def generate(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if len(prompt) >= self.n_ctx:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens, the context {self.n_ctx}")
        return self._generate(prompt, Sampler(params, resolve_seed(params)))

    def _generate(self, prompt: list[int], sampler: Sampler) -> Iterator[int]:
        """Lazy: the prompt is processed at the first ``next()``, and each further token costs
        one ``next()``, so a consumer that stops iterating stops the work."""
        model = self.model
        cache = make_prompt_cache(model)
        *body, last = prefill_chunks(prompt)
        for chunk in body:
            model(mx.array([chunk]), cache=cache)
            mx.eval([c.state for c in cache])
        step = last
        position = len(prompt)
        while True:
            logits = model(mx.array([step]), cache=cache)[:, -1, :]
            token = sampler(logits)
            yield token
            position += 1
            if position >= self.n_ctx:
                return
            step = [token]

    def piece(self, token: int) -> bytes:
        return self.text.piece(token)

    def is_end(self, token: int) -> bool:
        return self.text.is_end(token)
