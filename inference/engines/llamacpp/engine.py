"""The llama.cpp engine (llama-cpp-python), for GGUF models.

``Llama`` loads the model (it knows the RPC devices, tensor splits and threads) and the
tokenizer and chat template; the decoding is llama.cpp's low-level API, in a context of
``slots`` sequences that ``BatchDecoder`` (``llamacpp_batch``) decodes together, each with a
``SequenceSampler`` (``llamacpp_sampling``) that picks its tokens with llama.cpp's samplers and
grammars. A model with a projector file reads images (``vision.py``): the projector is loaded
after the model, on the GPU where the model's layers are (on the CPU at a pipeline's head), with
the runner's threads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import llama_cpp
from llama_cpp import Llama, llama_chat_format

from events.kinds import DEFAULT_KV_CACHE, KvCacheType
from inference.decoding import Decoding, PromptCached, PromptScores, Sink, Token
from inference.engines.llamacpp import vocabulary
from inference.engines.llamacpp.batch import BatchDecoder
from inference.engines.llamacpp.sampling import (
    GrammarCache,
    SequenceSampler,
    seed_of,
    token_piece,
)
from inference.engines.llamacpp.vision import Projector, projector_on_gpu
from inference.generation import check_against_vocabulary
from inference.image_markers import placed
from inference.image_spans import ImagePrompt, ImageSpan, unreadable
from inference.speculative import NgramLookup
from structured.reply import InvalidRequest

# Named chat formats a model card may ask for (as llama-cpp-python names them). A model without
# one uses the chat template in its GGUF.
_FORMATTERS: dict[str, Callable[..., Any]] = {
    "gemma": llama_chat_format.format_gemma,
    "chatml": llama_chat_format.format_chatml,
    "llama-2": llama_chat_format.format_llama2,
    "llama-3": llama_chat_format.format_llama3,
    "mistral-instruct": llama_chat_format.format_mistral_instruct,
}


@dataclass(frozen=True)
class _Loaded:
    llm: Llama
    vocab: Any  # llama_vocab pointer
    n_vocab: int
    decoder: BatchDecoder
    n_ctx: int  # per slot
    grammars: GrammarCache
    formatter: Callable[..., Any] | None
    # The same template without the generation prompt (what a client that counts a chat's
    # tokens may ask for); None for a named format, which always writes it.
    bare_formatter: Callable[..., Any] | None
    template: str | None  # the GGUF's Jinja template, when that is what chats go through
    ends: frozenset[int]
    projector: Projector | None  # what reads the chats' images, for a model with one


class LlamaCppEngine:
    def __init__(
        self,
        model_path: Path,
        *,
        n_ctx: int = 2048,
        slots: int = 1,
        chat_format: str | None = None,
        n_threads: int | None = None,
        projector: Path | None = None,
        projector_on_cpu: bool = False,
        kv_cache: KvCacheType = DEFAULT_KV_CACHE,
        speculative: NgramLookup | None = None,
        **llama_kwargs: Any,
    ) -> None:
        """``projector``: the model's multimodal projector file (its images are read), on
        the GPU where the model's layers are, or on the CPU with ``projector_on_cpu`` (a
        pipeline's head, whose GPU devices may be its stages' RPC servers). ``kv_cache``: the
        type of the slots' KV cache (K and V alike, as llama-server's ``-ctk/-ctv``).
        ``speculative``: draft by prompt lookup (``batch.py``); the tokens are the same."""
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if chat_format is not None and chat_format not in _FORMATTERS:
            raise ValueError(
                f"unknown chat format {chat_format!r}; known: {', '.join(sorted(_FORMATTERS))}"
            )
        self.path = model_path
        self._requested_ctx = n_ctx
        self.slots = slots
        self._chat_format = chat_format
        self._n_threads = n_threads or os.cpu_count() or 1
        self._kwargs = llama_kwargs
        self._projector = projector
        self._projector_on_cpu = projector_on_cpu
        self.kv_cache = kv_cache
        self.speculative = speculative
        self._loaded: _Loaded | None = None
        self._pieces: dict[int, bytes] = {}
        # Apply a grammar to every candidate, every token (llama.cpp's grammar_first), rather
        # than check the token picked first: for measurements.
        self.grammar_first = False

    def load(self) -> None:
        # ``Llama`` loads the model (devices, splits, threads); its own context is not used, and
        # is made small: the decoding context is made apart, for ``slots`` sequences, each with
        # the whole context asked for (Llama cannot make one with several sequences).
        llm = Llama(
            model_path=str(self.path),
            n_ctx=_LLAMA_OWN_CTX,
            n_threads=self._n_threads,
            n_threads_batch=self._n_threads,
            verbose=False,
            **self._kwargs,
        )
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        formatter: Callable[..., Any] | None = None
        bare_formatter: Callable[..., Any] | None = None
        template: str | None = None
        if self._chat_format is not None:
            formatter = _FORMATTERS[self._chat_format]
        elif template := llm.metadata.get("tokenizer.chat_template"):
            eos = _special_text(vocab, llm.token_eos())
            bos = _special_text(vocab, llm.token_bos())
            formatter = llama_chat_format.Jinja2ChatFormatter(template, eos, bos)
            bare_formatter = llama_chat_format.Jinja2ChatFormatter(
                template, eos, bos, add_generation_prompt=False
            )
        # Every end-of-generation token of the vocabulary ends it, as in llama-cpp-python's
        # own completions (and a grammar, once complete, allows only these).
        ends = {llm.token_eos()}
        ends.update(t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t))
        # A format's own stop marker (e.g. Gemma's <end_of_turn>) ends generation as a token.
        if self._chat_format is not None:
            assert formatter is not None
            stop = formatter(messages=[{"role": "user", "content": ""}]).stop
            for s in [stop] if isinstance(stop, str) else stop or []:
                ids = llm.tokenize(s.strip().encode(), add_bos=False, special=True)
                if len(ids) == 1:
                    ends.add(ids[0])
        ends_set = frozenset(ends)
        projector = None
        if self._projector is not None:
            projector = Projector(
                self._projector,
                llm.model,
                use_gpu=not self._projector_on_cpu and projector_on_gpu(self._kwargs),
                n_threads=self._n_threads,
            )

        def evaluate_image(ctx: Any, image: ImageSpan, seq: int, n_past: int) -> None:
            assert projector is not None
            projector.evaluate(ctx, image, seq, n_past, int(llama_cpp.llama_n_batch(ctx)))

        def make_context(sequences: int) -> Any:
            flash_attn_asked = "flash_attn" in self._kwargs
            return _context(
                llm,
                self._requested_ctx,
                sequences,
                flash_attn_asked=flash_attn_asked,
                kv_cache=self.kv_cache,
            )

        decoder = BatchDecoder(
            make_context,
            owner=llm,
            slots=self.slots,
            n_vocab=n_vocab,
            is_end=ends_set.__contains__,
            evaluate_image=evaluate_image if projector is not None else None,
            speculative=self.speculative,
        )
        self._loaded = _Loaded(
            llm=llm,
            vocab=vocab,
            n_vocab=n_vocab,
            decoder=decoder,
            n_ctx=decoder.n_ctx,
            grammars=GrammarCache(vocab),
            formatter=formatter,
            bare_formatter=bare_formatter,
            template=template or None,
            ends=ends_set,
            projector=projector,
        )

    @property
    def loaded(self) -> _Loaded:
        if self._loaded is None:
            raise RuntimeError("engine not loaded")
        return self._loaded

    @property
    def llm(self) -> Llama:
        return self.loaded.llm

    @property
    def n_ctx(self) -> int:
        """The context of one generation (each slot has one)."""
        return self.loaded.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.loaded.n_vocab

    @property
    def chat_template(self) -> str | None:
        return self.loaded.template

    # --- prompts ------------------------------------------------------------------------------

    def chat_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat as the model reads it, before tokenizing."""
        m = self.loaded
        formatter = m.formatter if add_generation_prompt else m.bare_formatter
        if m.formatter is None:
            raise InvalidRequest("this model has no chat template: send a plain prompt")
        if formatter is None:
            raise InvalidRequest(
                f"this model's chat format ({self._chat_format}) always ends with the"
                " generation prompt: add_generation_prompt cannot be false"
            )
        # Named formats know nothing of tools.
        extra: dict[str, Any] = {"tools": tools} if m.template is not None and tools else {}
        if m.template is not None and template_kwargs:
            extra = dict(template_kwargs) | extra
        if self._chat_format == "gemma":
            messages = _system_in_first_user(messages)
        try:
            return str(formatter(messages=messages, **extra).prompt)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            # A template's raise_exception, a role or a shape it does not take.
            raise InvalidRequest(f"the chat template rejected the messages: {exc}") from exc

    def chat_tokens(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        return self._tokens(self.chat_text(messages, tools, template_kwargs, add_generation_prompt))

    def text_tokens(self, prompt: str) -> list[int]:
        return self._tokens(prompt)

    # --- images (vision.py) -------------------------------------------------------------------

    def images_refused(self) -> str | None:
        """Why this engine reads no images; None: it reads them."""
        return None if self._projector is not None else _NO_PROJECTOR

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
        if self._projector is None:
            raise InvalidRequest(f"this model does not read images: {_NO_PROJECTOR}")
        projector = self.loaded.projector
        assert projector is not None
        text = self.chat_text(messages, tools, template_kwargs, add_generation_prompt)
        text, order = placed(text, projector.marker)
        shown = [images[i] for i in order]
        return projector.prompt(text, shown, self.llm.token_bos())

    def _tokens(self, text: str) -> list[int]:
        # Chat templates write the BOS token themselves; plain prompts get one added.
        llm = self.llm
        bos = llm.token_bos()
        tokens: list[int] = llm.tokenize(text.encode(), add_bos=True, special=True)
        if len(tokens) > 1 and tokens[0] == bos and tokens[1] == bos:
            tokens = tokens[1:]
        return tokens

    # --- the tokenizer, as clients ask it (vocabulary.py) ----------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return vocabulary.tokenize(self.llm, text, add_special, parse_special)

    def detokenize(self, tokens: list[int]) -> str:
        return vocabulary.detokenize(self.loaded.vocab, self.n_vocab, tokens)

    def vocabulary_text(self, token: int) -> str:
        return vocabulary.vocabulary_text(self.loaded.vocab, self.n_vocab, token)

    def tokenizer_info(self) -> dict[str, Any]:
        m = self.loaded
        return vocabulary.tokenizer_info(m.llm, m.vocab, m.n_vocab, m.template)

    # --- tokens ---------------------------------------------------------------------------------

    def piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            if not 0 <= token < self.n_vocab:
                return b""
            # Special tokens (end of turn and the like) show no text.
            piece = self._pieces[token] = token_piece(self.loaded.vocab, token, special=False)
        return piece

    def spelled(self, token: int) -> bytes:
        return token_piece(self.loaded.vocab, token) if 0 <= token < self.n_vocab else b""

    def is_end(self, token: int) -> bool:
        return token in self.loaded.ends

    # --- generation -----------------------------------------------------------------------------

    def generate(
        self, prompt: list[int], decoding: Decoding
    ) -> Generator[Token | PromptScores | PromptCached]:
        """Checks the request at once (``InvalidRequest``); decodes nothing before the first
        ``next()``. Up to ``slots`` generations are decoded together (``BatchDecoder``); more
        wait for a slot."""
        return self.loaded.decoder.generate(prompt, decoding, self._sampler_for(prompt, decoding))

    def submit(self, prompt: list[int], decoding: Decoding, sink: Sink) -> None:
        """The same, its items handed to ``sink`` on the decoding thread: a runner's steps
        are made there, between two decodes, with no thread to wake per token."""
        self.loaded.decoder.submit(prompt, decoding, self._sampler_for(prompt, decoding), sink)

    def _sampler_for(self, prompt: list[int], decoding: Decoding) -> Callable[[], SequenceSampler]:
        """The request checked (``InvalidRequest``), and how its sampler is made."""
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if len(prompt) >= self.n_ctx:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens, more than the model's context of "
                f"{self.n_ctx} tokens leaves room for"
            )
        m = self.loaded
        if decoding.images:
            if m.projector is None:
                raise InvalidRequest(f"this model does not read images: {_NO_PROJECTOR}")
            why = unreadable(decoding.images, len(prompt), decoding.echo)
            if why is not None:
                raise InvalidRequest(why)
        check_against_vocabulary(decoding.params, m.n_vocab, decoding.top_logprobs)
        grammar = m.grammars.get(decoding.grammar) if decoding.grammar else None
        seed = seed_of(decoding.params)

        def make() -> SequenceSampler:
            sampler = SequenceSampler(
                vocab=m.vocab,
                n_vocab=m.n_vocab,
                n_ctx=self.n_ctx,
                params=decoding.params,
                seed=seed,
                grammar=grammar,
                grammar_first=self.grammar_first,
                forced=decoding.forced,
            )
            sampler.take_generated(decoding.generated)
            return sampler

        return make

    def drop_cache(self) -> None:
        """Forget what the KV caches hold: the next generations run their prompts whole (for
        a run that does not depend on the last: a prompt run in pieces rounds a little
        differently from one run whole)."""
        self.loaded.decoder.drop_cache()

    def close(self) -> None:
        """Stop the decoding thread (generations in flight are left unfinished)."""
        if self._loaded is not None:
            self._loaded.decoder.close()
            if self._loaded.projector is not None:
                self._loaded.projector.close()

    def unload(self) -> None:
        """Close, then free the model now rather than when the process ends: a recycled
        runner process serves another model next (``shoal runner``)."""
        self.close()
        if self._loaded is not None:
            self._loaded.llm.close()
            self._loaded = None


# Why a model without a projector file refuses images.
_NO_PROJECTOR = "its model has no projector (mmproj) file"

# The context ``Llama`` makes for itself, unused (see ``load``).
_LLAMA_OWN_CTX = 64


# The ggml type of each KV-cache type.
_GGML_KV_TYPES: dict[KvCacheType, int] = {
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}


def _context(
    llm: Llama,
    n_ctx: int,
    sequences: int,
    *,
    flash_attn_asked: bool,
    kv_cache: KvCacheType = DEFAULT_KV_CACHE,
) -> Any:
    """A context for ``sequences`` of ``n_ctx`` tokens each, with ``Llama``'s settings
    (threads; flash attention if ``flash_attn_asked``, else llama.cpp's choice) and a KV cache
    of ``kv_cache`` type. Each sequence has its own part of the KV cache (not unified, as
    llama-server's is when given ``--parallel``): attention then reads only a sequence's own
    cells, where a unified cache of 8 sequences read all of theirs (about 10% fewer tokens/s
    at 8 streams here)."""
    params = llm.context_params
    if kv_cache != DEFAULT_KV_CACHE:
        # llama.cpp reads a quantized V cache only in its flash-attention kernels: on, rather
        # than left to a choice that could turn it off and fail the context.
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    elif not flash_attn_asked:
        # As llama.cpp's own server: flash attention where the backend has it (llama-cpp-python
        # turns it off unless asked); batched decoding gains most from it.
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
    params.type_k = params.type_v = _GGML_KV_TYPES[kv_cache]
    params.n_ctx = n_ctx * sequences
    params.n_seq_max = sequences
    params.n_batch = params.n_ubatch = _N_BATCH
    params.kv_unified = False
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not make a context of {sequences} x {n_ctx} tokens")
    return ctx


# Tokens a decode step takes at most (llama-cpp-python's and llama.cpp's default batch).
_N_BATCH = 512


def _system_in_first_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """llama-cpp-python's ``gemma`` format drops system messages (Gemma has no such role):
    their text goes at the start of the first user message instead, as Gemma's own template
    does."""
    system = "\n\n".join(str(m.get("content") or "") for m in messages if m["role"] == "system")
    rest = [m for m in messages if m["role"] != "system"]
    if not system:
        return rest
    for i, m in enumerate(rest):
        if m["role"] == "user":
            rest[i] = m | {"content": f"{system}\n\n{m.get('content') or ''}"}
            return rest
    return [{"role": "user", "content": system}, *rest]


def _special_text(vocab: Any, token: int) -> str:
    """A special token's text, for templates (``{{ bos_token }}``)."""
    if token < 0:
        return ""
    return bytes(llama_cpp.llama_vocab_get_text(vocab, token)).decode(errors="replace")
