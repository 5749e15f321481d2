"""`shoal events ...`: watching and exporting the log."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Annotated, Any, TextIO

import typer
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import ValidationError
from rich.console import Console

from bus.catalogue_doc import render
from bus.connection import connect
from bus.reader import read_stream
from bus.stores.claim_check import resolved, response_resolved
from bus.stores.parts import PartStore
from bus.streams import (
    CHUNKS_STREAM,
    DEADLETTER_STREAM,
    EVENTS_STREAM,
    STREAM_PREFIXES,
    all_subjects,
    ensure_streams,
    stream_of,
)
from cli.event_line import event_line
from cli.options import DEFAULT_NATS, NatsUrl, run_until_signal
from events.catalogue import ResponseStored, TaskCreated, parse_event
from events.subjects import ALL_EVENTS

app = typer.Typer(help="Watch and export the event log.", no_args_is_help=True)

STREAMS = {"events": EVENTS_STREAM, "chunks": CHUNKS_STREAM, "deadletter": DEADLETTER_STREAM}


def _stream_of(subject: str) -> str:
    stream = stream_of(subject)
    if stream is None:
        raise typer.BadParameter(
            f"{subject!r} is in no Shoal stream: subjects start with "
            + ", ".join(STREAM_PREFIXES.values())
        )
    return stream


@app.command()
def tail(
    subject: Annotated[str, typer.Argument(help="Subject filter.")] = ALL_EVENTS,
    nats: NatsUrl = DEFAULT_NATS,
    raw: Annotated[bool, typer.Option("--json", help="Print the JSON as stored.")] = False,
    last: Annotated[int, typer.Option(help="Also show this many earlier events.")] = 0,
) -> None:
    """Print events as they happen, one readable line each."""
    stream = _stream_of(subject)
    console = Console(highlight=False, soft_wrap=True)

    async def main(stop: asyncio.Event) -> None:
        nc = await connect(nats, name="shoal-events-tail")
        js = nc.jetstream()

        async def show(msg: Msg) -> None:
            md = msg.metadata
            if raw:
                console.print(msg.data.decode(errors="replace"), markup=False)
                console.file.flush()
                return
            try:
                event = parse_event(msg.data)
            except ValidationError:
                console.print(f"#{md.sequence.stream} [red]unreadable[/] {msg.subject}")
                return
            console.print(event_line(event, md.sequence.stream, md.timestamp))
            console.file.flush()  # line by line, also into a pipe (`| grep`)

        config = ConsumerConfig(deliver_policy=DeliverPolicy.NEW)
        if last > 0:
            info = await js.stream_info(stream)
            config = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=max(1, info.state.last_seq - last + 1),
            )
        sub = await js.subscribe(
            subject, stream=stream, cb=show, ordered_consumer=True, config=config
        )
        await stop.wait()
        await sub.unsubscribe()
        await nc.close()

    run_until_signal(main)


def dump_line(msg: Msg) -> dict[str, Any]:
    md = msg.metadata
    line: dict[str, Any] = {
        "seq": md.sequence.stream,
        "subject": msg.subject,
        "stored_at": md.timestamp.isoformat(),
    }
    if msg.headers:
        line["headers"] = dict(msg.headers)
    try:
        line["event"] = json.loads(msg.data)
    except ValueError:
        line["raw"] = msg.data.decode(errors="replace")
    return line


async def with_parts(parts: PartStore, line: dict[str, Any]) -> dict[str, Any]:
    """``line`` with the prompt parts its event names (bus/stores/parts.py) put back in the event,
    so that the dump holds the whole conversation and restores into a cluster without them."""
    kind = line.get("event", {}).get("type") if isinstance(line.get("event"), dict) else None
    if kind not in (TaskCreated.__name__, ResponseStored.__name__):
        return line
    event = parse_event(json.dumps(line["event"]).encode())
    if isinstance(event, TaskCreated) and (event.messages_ref or event.tools_ref):
        event = await resolved(parts, event)
    elif isinstance(event, ResponseStored) and (event.conversation_ref or event.input_items_ref):
        event = await response_resolved(parts, event)
    else:
        return line
    return line | {"event": event.model_dump(mode="json")}


async def dump_stream(
    nats: str,
    stream_key: str,
    from_seq: int,
    to_seq: int | None,
    out: TextIO,
    keep_refs: bool = False,
) -> int:
    stream = STREAMS[stream_key]
    nc = await connect(nats, name="shoal-events-dump")
    n = 0
    try:
        js = nc.jetstream()
        parts = PartStore(js)
        async for msg in read_stream(
            js, stream, all_subjects(stream), from_seq=from_seq, to_seq=to_seq
        ):
            line = dump_line(msg)
            if not keep_refs:
                line = await with_parts(parts, line)
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            n += 1
    finally:
        await nc.close()
    return n


@app.command()
def dump(
    nats: NatsUrl = DEFAULT_NATS,
    from_seq: Annotated[int, typer.Option(help="First stream sequence.")] = 1,
    to_seq: Annotated[int | None, typer.Option(help="Last stream sequence.")] = None,
    stream: Annotated[str, typer.Option(help="events, chunks or deadletter.")] = "events",
    output: Annotated[str, typer.Option("-o", "--output", help="File (default stdout).")] = "-",
    keep_refs: Annotated[
        bool,
        typer.Option(
            "--keep-refs",
            help="Leave prompt parts named by digest, as stored (default: put them back).",
        ),
    ] = False,
) -> None:
    """Write the log as JSON lines: seq, subject, stored_at, headers, event. A task's
    messages and tools, stored apart by digest, are put back in its event."""
    if stream not in STREAMS:
        raise typer.BadParameter(f"unknown stream {stream!r}: events, chunks or deadletter")

    if output == "-":
        n = asyncio.run(dump_stream(nats, stream, from_seq, to_seq, sys.stdout, keep_refs))
    else:
        with open(output, "w", encoding="utf-8") as fh:
            n = asyncio.run(dump_stream(nats, stream, from_seq, to_seq, fh, keep_refs))
    typer.echo(f"dumped {n} messages", err=True)


class RestoreError(ValueError):
    pass


async def restore_stream(nats: str, lines: TextIO) -> tuple[int, dict[str, int]]:
    """Publish dumped messages, in their order, into empty streams. Returns how many, and the
    last sequence of each stream written."""
    nc = await connect(nats, name="shoal-events-restore")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        checked: set[str] = set()
        last: dict[str, int] = {}
        n = 0
        for number, text in enumerate(lines, 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
                subject = line["subject"]
                data = (
                    json.dumps(line["event"], ensure_ascii=False).encode()
                    if "event" in line
                    else line["raw"].encode()
                )
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise RestoreError(
                    f"line {number}: not a line of `shoal events dump` ({exc})"
                ) from exc
            stream = _stream_of(subject)
            if stream not in checked:
                # The log's order is its meaning: appending to a log would interleave two.
                info = await js.stream_info(stream)
                if info.state.messages:
                    raise RestoreError(
                        f"stream {stream} holds {info.state.messages} messages:"
                        " restore into a new, empty cluster"
                    )
                checked.add(stream)
            ack = await js.publish(subject, data, headers=line.get("headers") or None)
            last[stream] = ack.seq
            n += 1
    finally:
        await nc.close()
    return n, last


@app.command()
def restore(
    source: Annotated[
        str, typer.Argument(help="A file written by `shoal events dump` (- for stdin).")
    ] = "-",
    nats: NatsUrl = DEFAULT_NATS,
) -> None:
    """Publish a dump back into a new cluster's empty streams, in order (with the same message
    ids, so JetStream drops a line published twice)."""
    try:
        if source == "-":
            n, last = asyncio.run(restore_stream(nats, sys.stdin))
        else:
            with open(source, encoding="utf-8") as fh:
                n, last = asyncio.run(restore_stream(nats, fh))
    except (RestoreError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    where = ", ".join(f"{stream} up to seq {seq}" for stream, seq in sorted(last.items()))
    typer.echo(f"restored {n} messages ({where or 'nothing'})", err=True)


@app.command()
def doc() -> None:
    """Print the event catalogue as Markdown (docs/events.md)."""
    sys.stdout.write(render())
