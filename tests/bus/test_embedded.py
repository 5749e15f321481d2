"""The embedded nats-server: free port, JetStream, clean stop, persistence, clear errors."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.connection import connect
from bus.embedded import EmbeddedNats, NatsServerError, find_binary, free_port, port_in_use
from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM, ensure_streams
from events.catalogue import NodeJoined, parse_event

SYSTEM_PORT = 4222


@pytest.fixture
def occupied_port() -> Iterator[int]:
    """A free port that this test then holds open (listening), so nothing else can bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port: int = s.getsockname()[1]
        assert port != SYSTEM_PORT
        yield port


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_binary_is_found() -> None:
    path = Path(find_binary())
    assert path.name == "nats-server"
    assert os.access(path, os.X_OK)


def test_free_port_is_free() -> None:
    port = free_port()
    assert 0 < port < 65536 and port != SYSTEM_PORT
    assert not port_in_use("127.0.0.1", port)


def test_default_port_is_free_and_not_4222(tmp_path: Path) -> None:
    srv = EmbeddedNats(tmp_path / "nats")
    assert srv.port != SYSTEM_PORT
    assert srv.url == f"nats://127.0.0.1:{srv.port}"
    assert not port_in_use(srv.host, srv.port)


async def test_starts_with_jetstream_and_stops(tmp_path: Path) -> None:
    srv = EmbeddedNats(tmp_path / "nats")
    srv.start()
    try:
        assert srv._proc is not None
        pid = srv._proc.pid
        assert port_in_use(srv.host, srv.port)
        nc = await connect(srv.url, name="t")
        try:
            js = nc.jetstream()
            account = await js.account_info()
            assert account.streams == 0
            await ensure_streams(js)
            ack = await Publisher(js).publish(NodeJoined(node_id="n", origin="n"))
            assert ack.seq == 1
        finally:
            await nc.close()
        assert (tmp_path / "nats" / "jetstream").is_dir()
        assert srv.log_path.is_file()
        assert "Server is ready" in srv.log_path.read_text()
    finally:
        srv.stop()
    assert srv._proc is None
    assert not _pid_alive(pid)
    assert not port_in_use(srv.host, srv.port)
    srv.stop()  # stopping twice is harmless


def test_context_manager_stops(tmp_path: Path) -> None:
    with EmbeddedNats(tmp_path / "nats") as srv:
        assert srv._proc is not None
        pid = srv._proc.pid
        assert port_in_use(srv.host, srv.port)
    assert not _pid_alive(pid)
    assert not port_in_use(srv.host, srv.port)


def test_given_port_is_used(tmp_path: Path) -> None:
    port = free_port()
    with EmbeddedNats(tmp_path / "nats", port=port) as srv:
        assert srv.port == port
        assert port_in_use("127.0.0.1", port)


def test_port_in_use_is_a_clear_error(tmp_path: Path, occupied_port: int) -> None:
    srv = EmbeddedNats(tmp_path / "nats", port=occupied_port)
    with pytest.raises(NatsServerError, match="already in use") as exc:
        srv.start(timeout=5)
    assert str(occupied_port) in str(exc.value)
    assert srv._proc is None  # nothing was started


def test_nothing_listens_after_failed_start(tmp_path: Path, occupied_port: int) -> None:
    with pytest.raises(NatsServerError):
        EmbeddedNats(tmp_path / "nats", port=occupied_port).start(timeout=5)
    # Our socket still owns the port.
    assert port_in_use("127.0.0.1", occupied_port)


def test_port_bound_but_not_listening_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))  # bound, no listen(): connect_ex does not see it
        port = s.getsockname()[1]
        with pytest.raises(NatsServerError) as exc:
            EmbeddedNats(tmp_path / "nats", port=port).start(timeout=5)
    assert "already in use" in str(exc.value)


async def test_data_persists_across_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / "nats"
    event = NodeJoined(node_id="survivor", origin="n", hostname="box")
    srv = EmbeddedNats(data_dir)
    srv.start()
    try:
        nc = await connect(srv.url, name="t")
        js = nc.jetstream()
        await ensure_streams(js)
        ack = await Publisher(js).publish(event)
        await nc.close()
    finally:
        srv.stop()
    assert not port_in_use(srv.host, srv.port)

    again = EmbeddedNats(data_dir)  # same data dir, maybe another port
    again.start()
    try:
        nc = await connect(again.url, name="t")
        js = nc.jetstream()
        info = await js.stream_info(EVENTS_STREAM)
        assert info.state.messages == 1
        stored = await js.get_msg(EVENTS_STREAM, ack.seq)
        assert stored.data is not None
        assert parse_event(stored.data) == event
        # Streams survive, so ensure_streams is a no-op and the log continues where it was.
        await ensure_streams(js)
        ack2 = await Publisher(js).publish(NodeJoined(node_id="next", origin="n"))
        assert ack2.seq == ack.seq + 1
        await nc.close()
    finally:
        again.stop()
    # The previous log is kept beside the new one.
    assert again.log_path.is_file()
    assert again.log_path.with_suffix(".log.prev").is_file()


def test_restart_same_object_same_port(tmp_path: Path) -> None:
    srv = EmbeddedNats(tmp_path / "nats")
    port = srv.port
    srv.start()
    srv.stop()
    srv.start()
    try:
        assert srv.port == port
        assert port_in_use(srv.host, port)
    finally:
        srv.stop()


def test_an_authenticated_cluster_keeps_its_routes_password_off_the_command_line(
    tmp_path: Path,
) -> None:
    server = EmbeddedNats(
        tmp_path,
        port=4222,
        host="0.0.0.0",
        cluster_name="shoal-abc",
        cluster_port=6222,
        routes=["nats-route://10.0.0.1:6222", "nats-route://10.0.0.2:6222"],
        route_password="p4ss",
    )
    config = server._config()
    assert 'routes: ["nats-route://shoal:p4ss@10.0.0.1:6222"' in config
    assert 'authorization { user: shoal, password: "p4ss" }' in config
    assert server.url == "nats://127.0.0.1:4222"  # local clients on a wildcard server
