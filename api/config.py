"""What an API process is told at start: where NATS and the projection are, and who may call it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from api.model_defaults import ModelDefaults
from bus.leaderless import RETRY_FOR_S
from events.images import MAX_IMAGES, MAX_TOTAL_PIXELS
from events.units import KiB, MiB
from projectors.projector import DEFAULT_NAME
from services.models.cache_budget import CacheSize
from services.models.weights_cache import WeightsCache
from services.paths import default_data_dir
from services.planner.on_demand import DEFAULT_KEEP_ALIVE_S

# The largest image a request may hold by default, decoded: a photo from a phone is 2-5 MiB.
DEFAULT_MAX_IMAGE_BYTES = 10 * MiB
OnDemandRoles = Literal["users", "admins"]
# Image URLs one request may name, and the bytes fetched for all of them (with
# --allow-image-urls): each is fetched and held before the task is queued.
DEFAULT_MAX_IMAGE_URLS = 8
DEFAULT_MAX_IMAGE_FETCH_BYTES = 32 * MiB
# The largest request body accepted by default (api/limits.py). A task is stored as events and
# prompt parts of up to NATS's max_payload each (1 MiB by default, bus/stores/parts.py), so a
# request may well be larger than one message: 32 of them, more than any model's context holds as
# text (128k tokens are about 0.5 MiB), and a bound on what one request makes the process hold.
DEFAULT_MAX_BODY = 32 * MiB
# How long a client may take to send a whole body (32 MiB at 10 Mbit/s take 27 s).
DEFAULT_BODY_TIMEOUT_S = 30.0
# A request's line and headers (browsers send the cookies of every application on localhost;
# nginx allows 32 KiB, h11 16 KiB), and how long they may take (api/http_protocol.py).
DEFAULT_MAX_HEADER_BYTES = 64 * KiB
DEFAULT_HEADER_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ApiConfig:
    nats_url: str
    db_url: str
    # Bearer keys; empty: no authentication (the API binds to 127.0.0.1 unless told otherwise).
    api_keys: frozenset[str] = frozenset()
    projector: str = DEFAULT_NAME
    # How long a request may wait for its task to finish (queueing included).
    task_timeout_s: float = 600.0
    # How long a request waits for the log to store its task and messages (NATS JetStream
    # without a leader, or without quorum) before it is answered 503 log_unavailable.
    log_wait_s: float = RETRY_FOR_S
    # How long a request for a model nothing serves waits while an instance of it is loaded on
    # demand (api/on_demand.py): placement, the weights' fetch, the load.
    load_timeout_s: float = 600.0
    # Whether such a request loads its model (False: a 503 saying no instance serves it).
    load_on_demand: bool = True
    # Who may change what is loaded: unload (Ollama's keep_alive 0), pin (keep_alive -1) and
    # load a model not yet on disk (a catalogue card, downloaded). "admins" (the default): a
    # user key's such request is a 403 saying an admin must do it; "users": any key
    # (--on-demand users; an API without keys is all admin anyway).
    on_demand: OnDemandRoles = "admins"
    # The planners' keep-alive of such a model (what Ollama's /api/ps says of its expiry).
    default_keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    # Per-model defaults of such an instance (--model-defaults: keep-alive, pinned, placement,
    # context; api/model_defaults.py).
    model_defaults: ModelDefaults = field(default_factory=ModelDefaults)
    # How long a task waits for its model to serve again (its runner restarting, its instance
    # placed anew) before it fails: a task resumed after its runner was lost, or one queued.
    resume_within_s: float = 60.0
    # How many requests may wait in this process for a slot of a model (api/admission.py);
    # None: 16 per slot of the model.
    max_queued: int | None = None
    # How long a model found able to serve is taken to still be (api/serving_verdicts.py).
    serving_ttl_s: float = 1.0
    # Names clients may use for a model (alias -> model id), besides instances' own aliases.
    aliases: Mapping[str, str] = field(default_factory=dict)
    # The model of a request that names none.
    default_model: str | None = None
    # The thinking budget of a request that sets none (--reasoning-budget); None: unbounded.
    reasoning_budget: int | None = None
    # The most tokens an answer has when its request sets no limit (--max-tokens, as
    # llama-server's --n-predict; a model's own default wins); None: until the context is full.
    max_tokens: int | None = None
    # How long a stored response of the Responses API is kept (OpenAI's: 30 days); 0: forever.
    response_ttl_s: float = 30 * 24 * 3600.0
    # The bytes of events one client of GET /v1/events may have waiting to be sent; a client
    # that would need more cannot keep up, and is told so and disconnected (api/cluster/
    # event_feed.py). Thousands of the log's events, a few seconds of token chunks.
    events_buffer_bytes: int = 8 * MiB
    # Origins whose browser pages may call the API (CORS); none: same-origin only. A request
    # from a page of another origin is refused (api/hosts.py).
    cors_origins: tuple[str, ...] = ()
    # The addresses the API listens on (its --host), and other names requests may be addressed
    # to (--allowed-host; '*': any): a request with another Host is refused (api/hosts.py).
    listen_hosts: tuple[str, ...] = ("127.0.0.1",)
    allowed_hosts: tuple[str, ...] = ()
    # Past these, a request is refused before its body is read (api/limits.py): 413, 408.
    max_body_bytes: int = DEFAULT_MAX_BODY
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    # Past these, a connection is answered 431 or 408 and closed (api/http_protocol.py).
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    # Connections served at once; past it, uvicorn answers 503 (None: half the process's open
    # files limit, at most 1024, as `connection_limit` says).
    max_connections: int | None = None
    # The largest image a request may hold, decoded (api/images/loading.py), and whether the
    # API fetches images given by http(s) URL (--allow-image-urls; public addresses only).
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    allow_image_urls: bool = False
    # What one request's images may be in all: images (each time one is sent counts), their
    # pixels (read from their headers: the engine decodes each), image URLs and the bytes
    # fetched for them (api/images/loading.py, bus/stores/images.py).
    max_images: int = MAX_IMAGES
    max_image_pixels: int = MAX_TOTAL_PIXELS
    max_image_urls: int = DEFAULT_MAX_IMAGE_URLS
    max_image_fetch_bytes: int = DEFAULT_MAX_IMAGE_FETCH_BYTES
    # Where a model pulled through the API (Ollama's /api/pull) is fetched to before it is
    # added, as `shoal models add` does (`shoal up` gives its own data directory's).
    models_dir: Path = field(default_factory=lambda: default_data_dir() / "models")
    # That worker's weights cache budget (`shoal up`'s --cache-size): a download that could
    # never fit it is refused before it starts (api/model_adding.py); None: the disk's free
    # space only.
    cache_size: CacheSize | None = None
    # The cache of a worker on this machine (`shoal up`'s), which gives what the API adds to
    # other nodes; None: what the API adds is stored in the models bucket.
    worker_models_dir: Path | None = None

    def served_from(self) -> WeightsCache | None:
        """Where an added model's files are linked for this machine's worker to serve."""
        directory = self.worker_models_dir
        return WeightsCache(directory) if directory is not None else None


def keys_from_env(value: str | None = None) -> frozenset[str]:
    """``SHOAL_API_KEYS``: keys separated by commas or whitespace."""
    text = os.environ.get("SHOAL_API_KEYS", "") if value is None else value
    return frozenset(k for k in text.replace(",", " ").split() if k)


def parse_aliases(
    items: list[str] | tuple[str, ...] | None, env: str | None = None
) -> dict[str, str]:
    """``NAME=MODEL`` items (``--alias``, repeatable) and ``SHOAL_MODEL_ALIASES`` (the same,
    separated by commas or whitespace); the command line wins."""
    text = os.environ.get("SHOAL_MODEL_ALIASES", "") if env is None else env
    aliases: dict[str, str] = {}
    for item in [*text.replace(",", " ").split(), *(items or ())]:
        name, sep, model = item.partition("=")
        if not sep or not name.strip() or not model.strip():
            raise ValueError(f"an alias is NAME=MODEL, not {item!r}")
        aliases[name.strip()] = model.strip()
    return aliases
