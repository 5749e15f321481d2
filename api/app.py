"""The HTTP API: ``create_app(config)`` builds it; ``shoal api`` and ``shoal up`` serve it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api import cluster_routes, errors, openai_routes
from api.config import ApiConfig
from api.context import ApiContext
from bus.connection import connect
from projectors import database


def create_app(config: ApiConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nc = await connect(config.nats_url, name="shoal-api")
        engine = database.create_engine(config.db_url)
        app.state.ctx = ApiContext(config, nc, engine)
        try:
            yield
        finally:
            await engine.dispose()
            await nc.drain()

    app = FastAPI(
        title="Shoal",
        summary="OpenAI-compatible API and cluster control for Shoal.",
        version="0.1.0",
        lifespan=lifespan,
    )
    errors.install(app)
    app.include_router(openai_routes.router)
    app.include_router(cluster_routes.router)
    app.include_router(cluster_routes.health)
    return app
