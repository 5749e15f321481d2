"""The names of the consumers runners pull from, and of what they listen to: one durable
consumer per model and kind of request, shared by its replicas."""

from __future__ import annotations

from events.catalogue import EmbeddingsRequested, TaskCancelled, TaskCreated
from events.subjects import escape_token


def tasks_consumer_name(model_id: str) -> str:
    return f"tasks-{escape_token(model_id).replace('%', '_')}"


def embeddings_consumer_name(model_id: str) -> str:
    return f"embeddings-{escape_token(model_id).replace('%', '_')}"


def rerank_consumer_name(model_id: str) -> str:
    """Rerank tasks are ``EmbeddingsRequested`` too: this consumer has the same filter as the
    embeddings one, and each role's runners leave the other's tasks (a model is a reranker or
    not, so that only one of them serves it)."""
    return f"rerank-{escape_token(model_id).replace('%', '_')}"


# A request a runner pulls: a generation task, or an embeddings (or rerank) one.
Pulled = TaskCreated | EmbeddingsRequested


def cancel_subject(task: TaskCreated) -> str:
    return TaskCancelled.subject_for(task.model_id, task.task_id)
