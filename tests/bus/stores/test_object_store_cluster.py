"""The models bucket on a 3-server NATS cluster: replicated as the streams are, so that a file
stored through one server is fetched, whole, after the server that led the bucket is lost."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bus.connection import connect
from bus.stores.object_fetch import fetch_file
from bus.stores.object_store import object_info, object_stream, put_file
from bus.streams import MODELS_BUCKET, StreamSettings, ensure_streams
from harness.clusters import NatsCluster
from harness.hosts import Network
from tests.bus.nats_cluster import make_leader, stream_info

pytestmark = pytest.mark.slow


async def test_a_file_outlives_the_server_that_led_its_bucket(
    tmp_path: Path, hosts: Network
) -> None:
    src = tmp_path / "w.bin"
    src.write_bytes(os.urandom(3 * 1024 * 1024))
    bucket = object_stream(MODELS_BUCKET)
    async with NatsCluster(tmp_path / "nats", hosts) as cluster:
        writer = await connect(cluster.urls_from(0), name="writer")
        reader = await connect(cluster.urls_from(2), name="reader")
        try:
            await ensure_streams(writer.jetstream(), StreamSettings(replicas=3))
            info = await stream_info(writer, bucket)
            assert info.config.num_replicas == 3
            await make_leader(writer, bucket, "n1")
            stored = await put_file(writer.jetstream(), MODELS_BUCKET, "w", src)

            cluster.servers[1].kill()  # the bucket's leader, without a word
            await stream_info(reader, bucket)  # a new leader answers
            found = await object_info(reader.jetstream(), MODELS_BUCKET, "w")
            assert found is not None and found.digest == stored.digest
            out = await fetch_file(reader.jetstream(), MODELS_BUCKET, found, tmp_path / "got")
            assert out.read_bytes() == src.read_bytes()
        finally:
            await writer.close()
            await reader.close()
