"""The records events are made of: the values nested inside them (a node's profile, a shard's
layers, a chat message, sampling parameters, usage...), and the types of their fields. Frozen
pydantic models, JSON on the wire as the events are (``events/catalogue.py``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from events.kinds import Engine

# Ids name subjects and rows, so they are never empty.
Id = Annotated[str, Field(min_length=1)]
# Numbers the projection stores in 32-bit INTEGER columns: an event that could not be stored
# is malformed (dead-lettered), rather than an event that stops the projector.
INT32_MAX = 2**31 - 1
Int32 = Annotated[int, Field(le=INT32_MAX)]


class Record(BaseModel):
    """A value nested inside an event."""

    # NaN and Infinity are not JSON (pydantic writes them as null): refused, not projected.
    model_config = ConfigDict(frozen=True, allow_inf_nan=False)


class GpuInfo(Record):
    index: int
    name: str
    memory_total: int = Field(description="Bytes.")
    memory_used: int = Field(description="Bytes.")
    utilisation: float | None = Field(default=None, description="Percent, 0-100.")


# The backends through which an engine runs on an accelerator (llama.cpp's CUDA, ROCm (HIP),
# Metal, Vulkan and SYCL; MLX's Metal and CUDA). A device is named by its backend and its
# index among that backend's devices: 'cuda0', 'metal0'.
AcceleratorBackend = Literal["cuda", "rocm", "metal", "vulkan", "sycl"]
ACCELERATOR_BACKENDS: tuple[AcceleratorBackend, ...] = get_args(AcceleratorBackend)


class Accelerator(Record):
    """A GPU (or other accelerator) with memory of its own, as its node's engines see it."""

    backend: AcceleratorBackend
    index: int = Field(ge=0, description="Its position among the backend's devices (CUDA1: 1).")
    name: str = ""
    memory_total: int = Field(
        description="Bytes the device can hold: the card's memory; for memory shared with the"
        " CPU (Apple silicon), the GPU's recommended working set."
    )
    memory_free: int | None = Field(default=None, description="Bytes free when profiled.")
    unified: bool = Field(
        default=False, description="Its memory is the node's RAM (Apple silicon, an iGPU)."
    )
    compute_capability: str | None = Field(default=None, description="NVIDIA's, e.g. '9.0'.")
    utilisation: float | None = Field(default=None, description="Percent, 0-100.")
    engines: list[Engine] = Field(
        default_factory=list,
        description="The engines on this node that can run on it (llamacpp, mlx); none: seen"
        " (by NVML) but not usable, e.g. llama.cpp built without CUDA.",
    )

    @property
    def device(self) -> str:
        """The device's name on its node: 'cuda0', 'metal0'."""
        return f"{self.backend}{self.index}"


class NetworkInterface(Record):
    name: str
    addresses: list[str] = Field(default_factory=list)
    is_up: bool = True
    speed_mbps: int | None = None


class NodeProfile(Record):
    ram_total: int = Field(description="Bytes.")
    ram_available: int = Field(description="Bytes.")
    swap_total: int = 0
    swap_used: int = 0
    cpu_count: int
    cpu_model: str = ""
    cpu_load: float = Field(default=0.0, description="Percent, 0-100, all cores.")
    disk_free: int = Field(default=0, description="Bytes free where models live.")
    memory_offered: int = Field(description="Bytes this node offers to placement.")
    interfaces: list[NetworkInterface] = Field(default_factory=list)
    gpus: list[GpuInfo] = Field(
        default_factory=list,
        description="NVIDIA GPUs as workers before `accelerators` reported them (device"
        " 'gpuN'); a newer worker reports every GPU in `accelerators` and none here.",
    )
    accelerators: list[Accelerator] = Field(
        default_factory=list, description="Every accelerator the node has, with its memory."
    )


class DeviceLayers(Record):
    """How many of a shard's layers one device of its node holds."""

    device: str = Field(description="'cpu', or an accelerator: 'cuda0', 'metal0'...")
    layers: int = Field(ge=1)


class ShardAssignment(Record):
    """One runner of a placed instance: which node/device holds which layers."""

    runner_id: Id
    node_id: Id
    device: str = Field(
        default="cpu",
        description="'cpu' or an accelerator on that node: the one that holds"
        " the shard, or with `devices`, its first accelerator (llama.cpp's main GPU).",
    )
    devices: list[DeviceLayers] = Field(
        default_factory=list,
        description="The shard's layers divided between devices of its node, in layer order"
        " (llama.cpp keeps the first layers on the CPU and offloads the rest); empty: all on"
        " `device`.",
    )
    replica: int = 0
    rank: int = Field(default=0, description="Position in the pipeline; 0 is the head.")
    world_size: int = 1
    start_layer: int
    end_layer: int = Field(description="Exclusive.")
    n_layers: int = Field(description="Layers of the whole model.")
    tensor_split: list[float] | None = None

    def device_layers(self) -> list[tuple[str, int]]:
        """The devices of its node and the layers each holds, in layer order."""
        if self.devices:
            return [(d.device, d.layers) for d in self.devices]
        return [(self.device, self.end_layer - self.start_layer)]


class ToolCall(Record):
    """A call an assistant made, as a chat's history carries it back."""

    id: str
    name: str
    arguments: str = Field(description="The arguments as JSON text, as the model wrote them.")


class PartRef(Record):
    """Parts stored on their own stream by digest (``bus/stores/parts.py``) that an event names
    instead of holding them: a chain of values, named by its last part."""

    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the last part.")
    parts: int = Field(ge=1, description="How many parts (messages, items) the chain holds.")
    bytes: int = Field(ge=0, description="Their stored size, all together.")


# The image formats Shoal accepts, by their bytes (api/images/formats.py).
ImageMediaType = Literal["image/png", "image/jpeg", "image/webp", "image/gif"]
IMAGE_MEDIA_TYPES: tuple[ImageMediaType, ...] = get_args(ImageMediaType)


class ImagePart(Record):
    """An image of a message. Its bytes never ride in an event: they are stored as prompt
    parts are (``bus/stores/images.py``), and ``ref`` names them; ``sha256`` is the image's own
    digest, the same however a client sent it."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the image's bytes.")
    media_type: ImageMediaType = Field(description="Its format, read from its bytes.")
    width: int = Field(ge=1, description="Pixels, as its header says.")
    height: int = Field(ge=1, description="Pixels, as its header says.")
    bytes: int = Field(ge=1, description="Its size.")
    ref: PartRef = Field(description="Its bytes, stored as parts (base64 pieces, in order).")
    at: int = Field(
        default=0,
        ge=0,
        description="Where in the message's `content` it goes: before the character at this"
        " offset (0: before the text; the content's length: after it).",
    )


class ChatMessage(Record):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[ImagePart] = Field(
        default_factory=list,
        description="Images among the content (a user's, a tool result's), in order.",
    )
    name: str | None = None
    tool_calls: list[ToolCall] = Field(
        default_factory=list, description="An assistant's calls of tools."
    )
    tool_call_id: str | None = Field(default=None, description="The call a tool message answers.")
    reasoning: str | None = Field(
        default=None,
        description="An assistant's thinking before its answer, as a client sent it back: the"
        " chat template keeps or drops it.",
    )


class Tool(Record):
    """A function the model may call: its JSON schema says what arguments it takes."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


ToolChoiceMode = Literal["auto", "none", "required", "function"]


class ToolChoice(Record):
    """Whether the model may (``auto``), may not (``none``) or must (``required``) call a
    tool, or must call the one named (``function``)."""

    mode: ToolChoiceMode = "auto"
    name: str | None = None


class ResponseFormat(Record):
    """What the reply must be: any JSON object, or JSON that validates against a schema."""

    type: Literal["json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = None


class SamplingParams(Record):
    max_tokens: Int32 | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = Field(default=0, description="0: no top-k cut.")
    min_p: float = 0.0
    repeat_penalty: float = Field(default=1.0, description="1: none.")
    logit_bias: dict[int, float] = Field(
        default_factory=dict, description="Added to a token's logit before sampling."
    )


# An image task's bounds (the API refuses more before anything is queued; the runner, again).
MAX_IMAGES_PER_TASK = 8
MAX_IMAGE_SIDE = 2048
MAX_IMAGE_STEPS = 150
MAX_PARTIAL_IMAGES = 3


class ImageParams(Record):
    """What an image task (``TaskCreated`` of kind ``image``) asks beyond its prompt."""

    # Every field has a default: a key it does not know is refused, so that a mistyped or
    # misplaced object is not taken for an image task of defaults.
    model_config = ConfigDict(frozen=True, allow_inf_nan=False, extra="forbid")

    n: int = Field(default=1, ge=1, le=MAX_IMAGES_PER_TASK, description="Images to make.")
    width: int = Field(default=512, ge=8, le=MAX_IMAGE_SIDE, description="Pixels.")
    height: int = Field(default=512, ge=8, le=MAX_IMAGE_SIDE, description="Pixels.")
    steps: int | None = Field(
        default=None, ge=1, le=MAX_IMAGE_STEPS, description="Denoising steps; None: the model's."
    )
    guidance: float | None = Field(
        default=None, ge=0.0, le=30.0, description="Classifier-free guidance; None: the model's."
    )
    seed: int | None = Field(
        default=None, ge=0, description="Image i is drawn with seed + i (None: 0)."
    )
    negative_prompt: str | None = None
    partial_images: int = Field(
        default=0,
        ge=0,
        le=MAX_PARTIAL_IMAGES,
        description="Partial images streamed per image, before the finished one.",
    )


# Chunks are hashable (their consumers keep sets of them): what they hold is in tuples.


class TopLogprob(Record):
    token: str
    logprob: float
    bytes: tuple[int, ...]


class TokenLogprob(Record):
    """A token with its log-probability under the model (the raw distribution, before
    penalties, biases, grammar and temperature), and the most likely alternatives."""

    token: str
    logprob: float | None = Field(description="None for a prompt's first token.")
    bytes: tuple[int, ...]
    top: tuple[TopLogprob, ...] = ()


class ToolCallDelta(Record):
    """A piece of a tool call as it is generated: the first piece of call ``index`` has its
    ``id`` and ``name``, later pieces carry fragments of its arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Speculative(Record):
    """Speculative decoding of an instance's runners: prompt lookup (llama-server's
    ``--spec-type ngram-simple``), drafts of up to ``draft_max`` tokens that followed the
    latest earlier occurrence of the context's last ``ngram_max`` (down to ``ngram_min``)
    tokens. The tokens generated are the same as without it."""

    # Required, though it has one value: what speculates is always named (a second kind, a draft
    # model, is a new value), and an object of defaults alone is not taken for a request.
    type: Literal["ngram"]
    draft_max: int = Field(16, ge=1, le=64, description="The most tokens a draft has.")
    ngram_min: int = Field(2, ge=1, le=16, description="The shortest n-gram looked up.")
    ngram_max: int = Field(4, ge=1, le=16, description="The longest n-gram looked up.")

    @model_validator(mode="after")
    def _sizes_in_order(self) -> Speculative:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} is more than ngram_max {self.ngram_max}")
        return self


class Usage(Record):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(
        0, description="Of the prompt tokens, those the runner's cache held: not computed again."
    )
    reasoning_tokens: int = Field(
        0,
        description="Of the completion tokens, those of a thinking model's thinking (its tags"
        " included).",
    )

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(Record):
    ttft_ms: float = Field(description="Time to first token, milliseconds.")
    tokens_per_s: float
    total_ms: float


FinishReason = Literal["stop", "length", "cancelled", "error", "tool_calls"]


class WeightFile(Record):
    """One file of a model's weights, named by its content: held in the cache of the node it was
    added on (and of every node that fetched it), or in the models bucket
    (``bus.streams.MODELS_BUCKET``)."""

    name: str = Field(
        min_length=1,
        description="Its path in the model's directory: 'model.gguf', 'config.json',"
        " 'model-00001-of-00002.safetensors'.",
    )
    object: str = Field(
        min_length=1,
        description="Its object's name in the models bucket (`sha256/<hex>`), whether or not"
        " the bucket holds a copy.",
    )
    size: int = Field(ge=0, description="Bytes.")
    sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the file, hex (the object's digest)."
    )
    projector: bool = Field(
        default=False,
        description="The model's multimodal projector (an `mmproj` GGUF), which llama.cpp loads"
        " beside the weights to read images: a model with one takes images.",
    )

    @model_serializer(mode="wrap")
    def _written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out when false: a model's files, replayed, stay as a log from before wrote them.
        written: dict[str, Any] = handler(self)
        if not self.projector:
            written.pop("projector", None)
        return written
