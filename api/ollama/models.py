"""Ollama's model endpoints, translated: the entries of ``/api/tags`` and ``/api/ps`` and the
answer of ``/api/show``, made from the projection's rows. Pure: rows in, dicts out."""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime
from typing import Any

from api.images.vision import accepts_images
from api.model_list import Askable
from api.ollama.replies import created_at
from events.kinds import main_engine
from events.states import SERVING
from projectors.rows import InstanceRow, ModelRow, RunnerRow
from projectors.state import ClusterState
from services.models.cards import HfSource, ModelCard, PackageSource

# A pinned instance has no idle timeout: it runs until deleted (what /api/ps says of it).
NEVER = "9999-12-31T23:59:59Z"


def tagged(name: str) -> str:
    """A name as Ollama lists it: with a tag (``:latest`` when it has none)."""
    return name if ":" in name else f"{name}:latest"


_PARAMS = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)([mMbB])(?![a-zA-Z])")
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.IGNORECASE
)


def _found(pattern: re.Pattern[str], *texts: str | None) -> re.Match[str] | None:
    for text in texts:
        match = pattern.search(text or "")
        if match:
            return match
    return None


def _file_names(model: ModelRow) -> list[str]:
    """The weights' file names: its path's, or those of its files in the models bucket."""
    names = [str(f.get("name", "")) for f in model.files or [] if isinstance(f, dict)]
    return [model.path or "", *names]


def parameter_size(model: ModelRow) -> str:
    """Best effort, from the model's name or file (``smollm2-135m`` -> ``135M``): Shoal's
    projection has no parameter count."""
    match = _found(_PARAMS, model.model_id, *_file_names(model))
    return f"{match.group(1)}{match.group(2).upper()}" if match else ""


def quantization(model: ModelRow) -> str:
    """Best effort, from the weights' file name (``...Q4_1.gguf`` -> ``Q4_1``)."""
    match = _found(_QUANT, *_file_names(model), model.source)
    return match.group(1).upper() if match else ""


def digest(model: ModelRow) -> str:
    """A stable stand-in for Ollama's manifest digest: the same model, the same digest."""
    text = f"{model.model_id}\0{model.source}\0{model.size_bytes}\0{model.added_at}"
    return hashlib.sha256(text.encode()).hexdigest()


def details(model: ModelRow) -> dict[str, Any]:
    return _details(model.engines, model.family, parameter_size(model), quantization(model))


def _details(engines: list[str] | None, family: str, parameters: str, quant: str) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "gguf" if main_engine(engines) == "llamacpp" else "mlx",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": parameters,
        "quantization_level": quant,
    }


def _card_files(card: ModelCard) -> list[str]:
    """The names its weights would be fetched by: a file (the Hub's, a package's), a repo."""
    source = card.source
    if isinstance(source, HfSource):
        return [source.filename or source.repo]
    if isinstance(source, PackageSource):
        return [source.file or source.package]
    return [source.path]


def card_details(card: ModelCard) -> dict[str, Any]:
    """``details`` of a catalogue card not added yet: from its id, variant and file names."""
    params = _found(_PARAMS, card.id, *_card_files(card))
    quant = _found(_QUANT, card.variant, *_card_files(card))
    return _details(
        list(card.engines),
        card.family,
        f"{params.group(1)}{params.group(2).upper()}" if params else "",
        quant.group(1).upper() if quant else "",
    )


def card_digest(card: ModelCard) -> str:
    """A stable stand-in for a digest of a card not added yet (another than once added)."""
    return hashlib.sha256(f"{card.id}\0{card.source.label()}".encode()).hexdigest()


def _modified(model: ModelRow) -> str:
    added = model.added_at or datetime.fromtimestamp(0, UTC)
    return created_at(added.timestamp())


def tag(name: str, model: ModelRow) -> dict[str, Any]:
    """One entry of ``/api/tags``."""
    return {
        "name": tagged(name),
        "model": tagged(name),
        "modified_at": _modified(model),
        "size": model.size_bytes,
        "digest": digest(model),
        "details": details(model),
    }


def card_tag(name: str, card: ModelCard) -> dict[str, Any]:
    """One entry of ``/api/tags`` for a catalogue card not added yet: none of its weights are
    in the cluster (``size`` 0, never modified); a request for it adds and loads it."""
    return {
        "name": tagged(name),
        "model": tagged(name),
        "modified_at": created_at(0),
        "size": 0,
        "digest": card_digest(card),
        "details": card_details(card),
    }


def listed(entry: Askable) -> dict[str, Any]:
    """One entry of ``/api/tags``, with Shoal's fields: ``loaded`` (an instance serves it
    now; the others load when asked for), ``added`` (the cluster has it; else a catalogue
    card, fetched when first asked for) and ``capabilities`` (as ``/api/show`` says them:
    ``vision`` for a model that reads images)."""
    if entry.model is not None:
        shown = tag(entry.name, entry.model)
    else:
        assert entry.card is not None  # an entry is a model or a card (api/model_list.py)
        shown = card_tag(entry.name, entry.card)
    return shown | {
        "loaded": entry.loaded,
        "added": entry.added,
        "capabilities": entry.capabilities,
    }


def vram_bytes(model: ModelRow, runners: list[RunnerRow]) -> int:
    """The part of the model on GPUs: its first replica's layers that are not on a CPU (a
    runner across a node's devices counts its layers on each)."""
    first = [r for r in runners if r.replica == 0]
    n_layers = model.n_layers or max((r.n_layers for r in first), default=0)
    on_gpu = sum(n for r in first for device, n in r.shard().device_layers() if device != "cpu")
    return model.size_bytes * on_gpu // n_layers if n_layers else 0


def serving_instance(state: ClusterState, model_id: str) -> InstanceRow | None:
    """The model's first placed instance whose head runner serves, a chat one first."""
    for inst in sorted(state.instances(), key=lambda i: (i.role != "chat", i.instance_id)):
        if inst.model_id != model_id or inst.status != "placed":
            continue
        if any(r.rank == 0 and r.state in SERVING for r in state.runners_of(inst.instance_id)):
            return inst
    return None


def running(
    name: str,
    model: ModelRow,
    instance: InstanceRow,
    runners: list[RunnerRow],
    expires_at: datetime | None = None,
) -> dict[str, Any]:
    """One entry of ``/api/ps``: a model with an instance that serves, and when it is unloaded
    if it stays idle (None: never, a pinned one)."""
    expiry = expires_at.astimezone(UTC).isoformat().replace("+00:00", "Z") if expires_at else NEVER
    return tag(name, model) | {
        "expires_at": expiry,
        "size_vram": vram_bytes(model, runners),
        "context_length": instance.context_length or model.context_length,
    }


def capabilities(roles: set[str], vision: bool = False) -> list[str]:
    """What ``/api/show`` says a model can do, by the roles of its instances (a model served
    by none is a generation model until an embedding instance says otherwise), and whether it
    reads images (``vision``: it has a projector file). Every chat model can call tools: the
    grammar makes the calls."""
    chat = "chat" in roles or not roles
    out = ["completion", "tools"] if chat else []
    out += ["vision"] if chat and vision else []
    return out + (["embedding"] if "embed" in roles else [])


def show(
    model: ModelRow, context_length: int, roles: set[str], paths: bool = False
) -> dict[str, Any]:
    """``/api/show``: what the projection knows of the model. Its chat template is the
    weights' own, applied by the runner: the API has no copy of it to show. ``paths``: the
    weights' path on the node that added them (an admin's to see); else only their source."""
    arch = model.family or "unknown"
    info: dict[str, Any] = {
        "general.architecture": arch,
        "general.basename": model.model_id,
        f"{arch}.context_length": context_length,
        f"{arch}.block_count": model.n_layers,
    }
    return {
        "modelfile": f"# Served by Shoal; models are added with `shoal models add`\n"
        f"FROM {(model.path if paths else None) or model.source}\n",
        "parameters": "",
        "template": "",
        "details": details(model),
        "model_info": info,
        "capabilities": capabilities(roles, accepts_images(model, None)),
        "modified_at": _modified(model),
    }
