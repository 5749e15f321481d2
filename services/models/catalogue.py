"""The catalogue: model cards shipped with Shoal, one TOML file per model in ``catalogue/``.

A file describes one model (``qwen3-8b``) and where its weights are: GGUF files on the Hugging
Face Hub at several quantisations, MLX conversions, or a Python package (the built-in models,
which need no network). Each becomes one card per variant:

    qwen3-8b             the default GGUF quantisation (gguf.default)
    qwen3-8b:q8_0        another GGUF quantisation
    qwen3-8b:mlx-4bit    an MLX conversion

The file also carries the architecture's numbers (layers, context, KV heads and head size,
vocabulary) and each variant's size, so that placement can estimate a model's memory before
anything is downloaded. Once the weights are here their own metadata replaces the estimate.
A model that reads images names its projector file (``[gguf.projector]``), which every GGUF
variant takes; an MLX variant that reads them says ``vision = true`` (its repository holds the
vision tower, which mlx-vlm reads).
"""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from events.kinds import Engine
from services.models.cards import CardEstimate, HfSource, ModelCard, PackageSource, ToolCalls
from services.models.footprint import engine_overhead_bytes

CATALOGUE_DIR = Path(__file__).parent / "catalogue"

Id = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.\-]*$")]
Quant = Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]+$")]


class CatalogueError(ValueError):
    """A card file that cannot be read or does not validate."""


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GgufQuant(_Strict):
    file: str = Field(
        description="The GGUF file in the repository; a split one's first part"
        " (<name>-00001-of-0000N.gguf), the others found by name."
    )
    size: int = Field(gt=0, description="Bytes of all its files (the Hub's figure).")
    repo: str | None = Field(default=None, description="Another repository than gguf.repo.")


class GgufProjector(_Strict):
    file: str = Field(description="The projector (mmproj) GGUF in the repository.")
    size: int = Field(gt=0, description="Bytes (the Hub's figure).")
    repo: str | None = Field(default=None, description="Another repository than gguf.repo.")


class GgufRepos(_Strict):
    repo: str
    default: Quant
    quants: dict[Quant, GgufQuant] = Field(min_length=1)
    projector: GgufProjector | None = Field(
        default=None, description="The model reads images with this projector file."
    )

    @model_validator(mode="after")
    def _default_is_a_quant(self) -> GgufRepos:
        if self.default not in self.quants:
            raise ValueError(f"default {self.default!r} is none of {sorted(self.quants)}")
        return self


class MlxVariant(_Strict):
    repo: str = Field(description="An MLX conversion's repository (mlx-community/...).")
    size: int = Field(gt=0, description="Bytes of its safetensors files.")
    vision: bool = Field(
        default=False, description="It holds a vision tower (read with mlx-vlm): it reads images."
    )


class PackageWeights(_Strict):
    package: str
    module: str
    file: str | None = None
    assemble: bool = False
    size: int = Field(gt=0)


class CatalogueEntry(_Strict):
    """One card file."""

    id: Id
    family: str = Field(min_length=1)
    description: str = Field(min_length=1)
    context_length: int = Field(gt=0, description="Trained context, tokens.")
    n_layers: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    chat_format: str | None = Field(
        default=None, description="llama-cpp-python chat format; none: the GGUF's template."
    )
    tool_calls: ToolCalls = Field(
        default="generic", description="How its chat template has it write tool calls."
    )
    gguf: GgufRepos | None = None
    mlx: dict[Quant, MlxVariant] = Field(default_factory=dict)
    package: PackageWeights | None = None

    @model_validator(mode="after")
    def _has_weights(self) -> CatalogueEntry:
        if self.gguf is None and self.package is None and not self.mlx:
            raise ValueError("a card names its weights: [gguf], [mlx.<quant>] or [package]")
        if self.gguf is not None and self.package is not None:
            raise ValueError("[gguf] or [package] is its default weights, not both")
        return self

    def kv_bytes_per_token(self) -> int:
        """K and V for one token in every layer, f16 (as ``metadata.kv_cache_bytes``)."""
        return 2 * self.n_layers * self.kv_heads * self.head_dim * 2

    def cards(self) -> list[ModelCard]:
        def card(
            card_id: str,
            engine: Engine,
            source: PackageSource | HfSource,
            size: int,
            variant: str,
            projector: GgufProjector | None = None,
            vision: bool = False,
        ) -> ModelCard:
            gguf_repo = self.gguf.repo if self.gguf is not None else ""
            return ModelCard(
                id=card_id,
                family=self.family,
                description=self.description,
                engines=[engine],
                chat_format=self.chat_format if engine == "llamacpp" else None,
                tool_calls=self.tool_calls,
                variant=variant,
                source=source,
                estimate=CardEstimate(
                    n_layers=self.n_layers,
                    context_length=self.context_length,
                    size_bytes=size,
                    kv_bytes_per_token=self.kv_bytes_per_token(),
                    overhead_bytes=engine_overhead_bytes(self.vocab_size),
                    projector_bytes=projector.size if projector is not None else 0,
                ),
                projector=None
                if projector is None
                else HfSource(repo=projector.repo or gguf_repo, filename=projector.file),
                vision=vision,
            )

        out: list[ModelCard] = []
        if self.package is not None:
            p = self.package
            source = PackageSource(
                package=p.package, module=p.module, file=p.file, assemble=p.assemble
            )
            out.append(card(self.id, "llamacpp", source, p.size, "package"))
        if self.gguf is not None:
            for quant, q in self.gguf.quants.items():
                hf = HfSource(repo=q.repo or self.gguf.repo, filename=q.file)
                card_id = self.id if quant == self.gguf.default else f"{self.id}:{quant.lower()}"
                out.append(card(card_id, "llamacpp", hf, q.size, quant, self.gguf.projector))
        for quant, m in self.mlx.items():
            out.append(
                card(
                    f"{self.id}:mlx-{quant.lower()}",
                    "mlx",
                    HfSource(repo=m.repo),
                    m.size,
                    f"mlx-{quant}",
                    vision=m.vision,
                )
            )
        return out


def _family_and_size(entry: CatalogueEntry) -> tuple[str, int]:
    sizes = [c.estimate.size_bytes for c in entry.cards() if c.estimate is not None]
    return entry.family, min(sizes, default=0)


def load_entry(path: Path) -> CatalogueEntry:
    try:
        entry = CatalogueEntry.model_validate(tomllib.loads(path.read_text()))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'card'}: "
            + e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        )
        raise CatalogueError(f"{path.name}: {problems}") from exc
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CatalogueError(f"{path.name}: {exc}") from exc
    if entry.id != path.stem:
        raise CatalogueError(f"{path.name}: its id is {entry.id!r}, not the file's name")
    return entry


@functools.cache
def catalogue_entries(directory: Path = CATALOGUE_DIR) -> tuple[CatalogueEntry, ...]:
    """Every card file, in id order."""
    return tuple(load_entry(p) for p in sorted(directory.glob("*.toml")))


@functools.cache
def catalogue_cards(directory: Path = CATALOGUE_DIR) -> dict[str, ModelCard]:
    """Every variant's card, by id (a family's models smallest first, each model's variants
    together); ``CatalogueError`` when two share an id."""
    cards: dict[str, ModelCard] = {}
    for entry in sorted(catalogue_entries(directory), key=_family_and_size):
        for card in entry.cards():
            if card.id in cards:
                raise CatalogueError(f"{entry.id}.toml: a second card {card.id!r}")
            cards[card.id] = card
    return cards


class UnknownModel(LookupError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown model"


def builtin_cards() -> dict[str, ModelCard]:
    """The cards that ship with Shoal (the catalogue's), by id."""
    return catalogue_cards()


def card_for(model_id: str) -> ModelCard:
    """The card for ``model_id``; ``UnknownModel`` says how to find or add one otherwise."""
    cards = builtin_cards()
    try:
        return cards[model_id.removesuffix(":latest")]
    except KeyError:
        raise UnknownModel(
            f"no model card {model_id!r} (`shoal models list` shows them, `shoal models search"
            f" TEXT` searches the Hub); add others with `shoal models add {model_id} --path FILE`"
            " or `--hf REPO --file FILE`"
        ) from None
