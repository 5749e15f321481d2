"""The rerank request and response (``api/rerank/translate.py``), as pure translation: the
shape llama.cpp's server, vLLM, Jina and Cohere share."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from api.rerank.translate import MAX_DOCUMENTS, RerankRequest, ranked, rerank_response


def request(**fields: object) -> RerankRequest:
    return RerankRequest.model_validate({"query": "q", "documents": ["a", "b"], **fields})


def test_documents_are_texts_or_objects_with_text() -> None:
    body = request(documents=["plain", {"text": "object"}], model="m", top_n=1)
    assert body.texts() == ["plain", "object"]
    assert (body.model, body.top_n, body.return_documents) == ("m", 1, False)
    assert request(model=None).model is None  # the default model's


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"documents": []}, "documents is an empty list"),
        ({"documents": [{"image": "x.png"}]}, "document 0 has no text"),
        ({"documents": [{"text": "a", "title": "t"}]}, "Extra inputs"),
        ({"documents": ["x"] * (MAX_DOCUMENTS + 1)}, f"at most {MAX_DOCUMENTS}"),
        ({"query": ""}, "the query is empty"),
        ({"top_n": 0}, "greater than or equal to 1"),
        ({"rank_fields": ["title"]}, "`rank_fields` is not supported"),
        ({"max_tokens_per_doc": 100}, "`max_tokens_per_doc` is not supported"),
        ({"max_chunks_per_doc": 2}, "`max_chunks_per_doc` is not supported"),
    ],
)
def test_what_cannot_be_honoured_is_refused(fields: dict[str, object], said: str) -> None:
    with pytest.raises(ValidationError, match=said):
        request(**fields)
    with pytest.raises(ValidationError, match="query"):
        RerankRequest.model_validate({"documents": ["a"]})


def test_results_go_from_the_most_relevant_down() -> None:
    scores = np.array([[0.5], [2.0], [-1.0], [2.0]], dtype=np.float32)
    assert ranked(scores, None) == [1, 3, 0, 2]  # a tie keeps the documents' order
    assert ranked(scores, 2) == [1, 3]
    assert ranked(scores, 10) == [1, 3, 0, 2]


def test_the_answer_s_shape() -> None:
    scores = np.array([[0.25], [1.5]], dtype=np.float32)
    out = rerank_response("rerank-1", "m", ["a", "b"], scores, 12, top_n=None)
    assert out == {
        "id": "rerank-1",
        "model": "m",
        "object": "list",
        "results": [
            {"index": 1, "relevance_score": 1.5},
            {"index": 0, "relevance_score": 0.25},
        ],
        "usage": {"prompt_tokens": 12, "total_tokens": 12},
    }
    with_docs = rerank_response("r", "m", ["a", "b"], scores, 12, top_n=1, return_documents=True)
    assert with_docs["results"] == [{"index": 1, "relevance_score": 1.5, "document": {"text": "b"}}]
