"""The rerank request and response, as pure translation: the shape llama.cpp's server, vLLM,
Jina and Cohere share.

A request is ``{model, query, documents, top_n?, return_documents?}``; a document is a text or
``{"text": ...}`` (Jina's and vLLM's object form). The answer is ``{id, model, object,
results, usage}``, the results ``{index, relevance_score, document?}`` from the most relevant
down (``top_n`` of them when given), ``document`` (``{"text"}``) when ``return_documents``.
The scores are the model's own (a cross-encoder's logit, as llama.cpp's server gives them),
not squashed into 0..1. What Shoal cannot honour (Cohere's ``rank_fields``, chunking or
per-document token limits, documents that are not text) is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from events.records import INT32_MAX
from events.vectors import Vectors

# As many documents as one embeddings request may have inputs.
MAX_DOCUMENTS = 2048


class TextDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str


Document = str | TextDocument

# Fields other APIs have that Shoal cannot honour: refused rather than ignored.
_UNSUPPORTED = {
    "rank_fields": "documents are ranked by their text only",
    "max_chunks_per_doc": "documents are not split into chunks",
    "max_tokens_per_doc": "documents are not cut to a number of tokens",
}


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str
    documents: list[Document]
    top_n: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    return_documents: bool = False
    user: Annotated[str, Field(max_length=255)] | None = None

    @field_validator("query")
    @classmethod
    def _query(cls, value: str) -> str:
        if not value:
            raise ValueError("the query is empty")
        return value

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("documents is an empty list: send at least one document")
            if len(value) > MAX_DOCUMENTS:
                raise ValueError(f"{len(value)} documents: at most {MAX_DOCUMENTS} in one request")
            for i, doc in enumerate(value):
                if isinstance(doc, dict) and "text" not in doc:
                    raise ValueError(
                        f"document {i} has no text (documents are texts, or objects with"
                        " `text`: other kinds are not ranked here)"
                    )
        return value

    @model_validator(mode="after")
    def _honoured(self) -> RerankRequest:
        for name in self.model_extra or {}:
            if name in _UNSUPPORTED:
                raise ValueError(f"`{name}` is not supported: {_UNSUPPORTED[name]}")
        return self

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


def ranked(scores: Vectors, top_n: int | None) -> list[int]:
    """The documents' indexes from the highest score down (ties in order), ``top_n`` of them
    when given."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i][0]), i))
    return order if top_n is None else order[:top_n]


def rerank_response(
    request_id: str,
    model: str,
    texts: list[str],
    scores: Vectors,
    prompt_tokens: int,
    top_n: int | None = None,
    return_documents: bool = False,
) -> dict[str, Any]:
    """The answer: the documents by relevance, and the tokens read."""
    results: list[dict[str, Any]] = []
    for i in ranked(scores, top_n):
        result: dict[str, Any] = {"index": i, "relevance_score": float(scores[i][0])}
        if return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {
        "id": request_id,
        "model": model,
        "object": "list",
        "results": results,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
