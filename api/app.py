"""The HTTP API: ``create_app(config)`` builds it; ``shoal api`` and ``shoal up`` serve it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from nats.aio.msg import Msg

from api import errors, metrics, refusals
from api.admission import Admission
from api.anthropic import routes as anthropic_routes
from api.cluster import metrics_routes
from api.cluster import routes as cluster_routes
from api.cluster.dashboard import install as install_dashboard
from api.config import ApiConfig
from api.context import ApiContext
from api.limits import RequestGuard, limits_of
from api.ollama import routes as ollama_routes
from api.openai import routes as openai_routes
from api.openai.embeddings_routes import router as embeddings_router
from api.openai.images_routes import router as images_router
from api.rerank.routes import router as rerank_router
from api.responses.routes import router as responses_router
from api.serving_verdicts import ServingVerdicts
from api.tokenizer.routes import router as tokenizer_router
from bus.connection import connect
from events.catalogue import InstanceDeleted, InstanceDeleteRequested
from projectors import database


def create_app(config: ApiConfig) -> FastAPI:
    counted = metrics.ApiMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nc = await connect(config.nats_url, name="shoal-api")
        engine = database.create_engine(config.db_url)
        reader = database.sqlite_reader(config.db_url)
        verdicts = ServingVerdicts(config.serving_ttl_s)
        app.state.ctx = ApiContext(
            config,
            nc,
            engine,
            counted,
            verdicts,
            reader=reader,
            admission=Admission(config.max_queued),
        )

        async def forget(_msg: Msg) -> None:  # an instance unloaded: its yes no longer holds
            verdicts.forget()

        subs = [
            await nc.subscribe(kind.filter_for(), cb=forget)
            for kind in (InstanceDeleteRequested, InstanceDeleted)
        ]
        try:
            yield
        finally:
            for sub in subs:
                await sub.unsubscribe()
            await engine.dispose()
            if reader is not None:
                reader.dispose()
            await nc.drain()

    app = FastAPI(
        title="Shoal",
        summary="OpenAI-compatible API and cluster control for Shoal.",
        version="0.1.0",
        lifespan=lifespan,
    )
    errors.install(app, lambda request, err: refusals.note(counted, request.scope, err))
    # Inside the metrics (its refusals are counted) and CORS (an allowed page reads them).
    app.add_middleware(RequestGuard, limits=limits_of(config))
    metrics_routes.install(app, counted)
    if config.cors_origins:
        # Outermost: a browser's preflight is answered before keys are asked for. A wildcard
        # never comes with credentials (browsers refuse that pair, and it would be unsafe).
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_credentials="*" not in config.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["*"],
        )
    app.include_router(anthropic_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(embeddings_router)
    app.include_router(images_router)
    app.include_router(rerank_router)
    app.include_router(responses_router)
    app.include_router(ollama_routes.router)
    app.include_router(tokenizer_router)
    app.include_router(cluster_routes.router)
    app.include_router(cluster_routes.health)
    install_dashboard(app)  # the page at / and its files at /static
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, saying what the API sends: a 400 in OpenAI's error shape where
    FastAPI would list its own 422 (which this API never sends)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {"description": "Invalid request", **error}
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    app.openapi_schema = schema
    return schema
