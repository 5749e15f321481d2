"""An embed instance next to a running chat one, for the SDK tests of embeddings."""

from __future__ import annotations

import asyncio

import httpx


async def add_embed_instance(base: str, key: str, model: str, timeout: float = 180) -> None:
    """Ask for an embed instance of ``model``, and wait until ``/v1/embeddings`` answers."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as client:
        asked = await client.post("/v1/instances", json={"model": model, "role": "embed"})
        assert asked.status_code == 202, asked.text
        async with asyncio.timeout(timeout):
            while True:
                r = await client.post("/v1/embeddings", json={"model": model, "input": "ready?"})
                if r.status_code == 200:
                    return
                assert r.status_code == 503, r.text  # placed, loading
                await asyncio.sleep(0.5)
