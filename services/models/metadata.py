"""What a model file says about itself: layers, context, heads, vocabulary, chat template.

Placement needs the layer count and the memory a model takes, and those come from the file's
own metadata, never from a name or a guess.

GGUF: the header is parsed here with the ``gguf`` package's definitions (magic, value types,
key names, file types). ``gguf.GGUFReader`` itself is not used for this: it turns every
element of every array into numpy objects, slow for a large vocabulary (Gemma 3 has 262,144
strings; docs/models.md has the figures), and placement needs none of the vocabulary, only its
length. This parser skips arrays it does not need, and a test checks it against
``GGUFReader`` field by field.

MLX: a model directory's ``config.json`` (Hugging Face layout).
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

from gguf import Keys, LlamaFileType
from pydantic import BaseModel, ConfigDict, Field

from modelfiles.gguf_header import GgufError as GgufError
from modelfiles.gguf_header import SkippedArray, read_header
from modelfiles.shard_files import split_parts

# Re-exported: the engine's working memory is footprint's (which needs no gguf to import).
from services.models.footprint import (
    OVERHEAD_FIXED_BYTES as OVERHEAD_FIXED_BYTES,
)
from services.models.footprint import (
    OVERHEAD_PER_VOCAB_BYTES as OVERHEAD_PER_VOCAB_BYTES,
)
from services.models.footprint import (
    engine_overhead_bytes as engine_overhead_bytes,
)


class GgufInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    architecture: str
    name: str | None = None
    n_layers: int = Field(description="Transformer blocks ({arch}.block_count).")
    context_length: int = Field(description="Trained context, tokens.")
    n_embd: int
    n_head: int
    n_head_kv: int = Field(description="KV heads; the largest when it differs per layer.")
    n_head_kv_per_layer: list[int] | None = Field(
        default=None, description="Only for architectures whose KV heads differ per layer."
    )
    key_length: int = Field(description="Per-head K size ({arch}.attention.key_length).")
    value_length: int = Field(description="Per-head V size.")
    sliding_window: int | None = None
    vocab_size: int
    chat_template: str | None = None
    file_type: str | None = Field(default=None, description="E.g. 'Q4_K_M' (general.file_type).")
    tensor_types: dict[str, int] = Field(
        default_factory=dict, description="Tensor count per GGML type, e.g. {'Q4_1': 211}."
    )
    n_tensors: int
    size_bytes: int = Field(description="File size.")

    @property
    def head_dim(self) -> int:
        return self.key_length


def read_gguf(path: Path | str) -> GgufInfo:
    """The metadata of the GGUF file at ``path``; ``GgufError`` if it is not one."""
    p = Path(path)
    kv, tensor_types = read_header(p)
    return _info(p, kv, tensor_types, _split_size(p, kv))


def _split_size(p: Path, kv: dict[str, Any]) -> int:
    """The bytes of the whole model: a split GGUF's first part holds the metadata, and its
    other parts (``<prefix>-0000i-of-0000N.gguf``, beside it) the rest of the tensors."""
    count = kv.get(Keys.Split.LLM_KV_SPLIT_COUNT)
    if not isinstance(count, int) or count <= 1:
        return p.stat().st_size
    parts = [p.parent / name for name in split_parts(p.name)]
    if len(parts) != count:
        raise GgufError(f"{p} is part of a GGUF split in {count}, but its name does not say so")
    missing = [q.name for q in parts if not q.is_file()]
    if missing:
        raise GgufError(f"{p}: parts of this split GGUF are missing: {', '.join(missing)}")
    return sum(q.stat().st_size for q in parts)


def info_from_header(
    name: str, kv: dict[str, Any], tensor_types: Counter[str], size: int
) -> GgufInfo:
    """``GgufInfo`` of a header read by ``parse_gguf_header``, for a model of ``size`` bytes."""
    return _info(Path(name), kv, tensor_types, size)


def kv_cache_bytes(info: GgufInfo, n_ctx: int, bytes_per_elem: int = 2) -> int:
    """K and V for ``n_ctx`` tokens in every layer (f16 by default, as llama.cpp allocates).
    With equal K and V head sizes this is 2 * n_layers * n_ctx * n_head_kv * head_dim * bytes.
    Sliding-window layers are counted at full size: llama.cpp may allocate less for them, and
    placement should not promise memory that a different setting would need."""
    heads = info.n_head_kv_per_layer or [info.n_head_kv] * info.n_layers
    per_token = sum(h * (info.key_length + info.value_length) for h in heads)
    return per_token * n_ctx * bytes_per_elem


class ModelFacts(BaseModel):
    """What ``ModelAdded`` carries about the weights, for either engine."""

    model_config = ConfigDict(frozen=True)

    n_layers: int
    context_length: int
    size_bytes: int
    kv_bytes_per_token: int = 0
    overhead_bytes: int = 0
    chat_template: str | None = None
    vision: bool = False  # an MLX directory with a vision tower (its config has vision_config)


def model_facts(path: Path | str, engine: str = "llamacpp") -> ModelFacts:
    """Layers, context and size of a GGUF file (llamacpp) or an MLX model directory."""
    p = Path(path)
    if engine == "mlx":
        return read_mlx_config(p)
    if engine == "diffusers":
        return read_diffusers_pipeline(p)
    if p.is_dir():
        raise GgufError(f"{p} is a directory; the llamacpp engine needs a .gguf file")
    return gguf_facts(read_gguf(p))


def gguf_facts(info: GgufInfo) -> ModelFacts:
    """What ``ModelAdded`` carries of a GGUF header."""
    return ModelFacts(
        n_layers=info.n_layers,
        context_length=info.context_length,
        size_bytes=info.size_bytes,
        kv_bytes_per_token=kv_cache_bytes(info, 1),
        overhead_bytes=engine_overhead_bytes(info.vocab_size),
        chat_template=info.chat_template,
    )


def read_mlx_config(directory: Path) -> ModelFacts:
    """An MLX (Hugging Face layout) model directory: ``config.json`` and its weight files."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise GgufError(f"{directory}: an MLX model is a directory with a config.json")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise GgufError(f"{config_path}: not readable JSON ({exc})") from exc
    # Multimodal models (Gemma 3, Qwen-VL...) keep the language model's numbers in text_config.
    text = config.get("text_config") or {}
    layers = config.get("num_hidden_layers", text.get("num_hidden_layers"))
    context = config.get("max_position_embeddings", text.get("max_position_embeddings", 0))
    if not isinstance(layers, int) or layers <= 0:
        raise GgufError(f"{config_path}: no num_hidden_layers")
    weights = [f for f in directory.iterdir() if f.suffix in (".safetensors", ".npz")]
    if not weights:
        raise GgufError(f"{directory}: no .safetensors weights")
    template = None
    tokenizer_config = directory / "tokenizer_config.json"
    if tokenizer_config.is_file():
        value = json.loads(tokenizer_config.read_text()).get("chat_template")
        template = value if isinstance(value, str) else None
    return ModelFacts(
        n_layers=layers,
        context_length=int(context or 0),
        size_bytes=sum(f.stat().st_size for f in weights),
        kv_bytes_per_token=_mlx_kv_bytes_per_token(config | text, layers),
        overhead_bytes=engine_overhead_bytes(
            int(config.get("vocab_size", text.get("vocab_size", 0)))
        ),
        chat_template=template,
        vision=isinstance(config.get("vision_config"), dict),
    )


# What a diffusers runner holds besides its weights: PyTorch and diffusers themselves (measured:
# ~0.4 GB resident after import), and the activations of one image at 1024 x 1024, the largest
# size the catalogue's models are made for. The largest is the VAE decoder's last block: its
# channels at every pixel, in float32, a few tensors alive at once.
TORCH_RUNTIME_BYTES = 512 * 1024 * 1024
IMAGE_SIDE = 1024
LIVE_TENSORS = 4


def read_diffusers_pipeline(directory: Path) -> ModelFacts:
    """A diffusers pipeline directory (``model_index.json``, a folder per component): its
    weights' size (safetensors where a component has them, else its other weight files), and
    the memory it needs besides, as ``overhead_bytes``. One layer: a pipeline is never split."""
    index = directory / "model_index.json"
    if not directory.is_dir() or not index.is_file():
        raise GgufError(f"{directory}: a diffusers pipeline is a directory with a model_index.json")
    weights: dict[Path, list[Path]] = {}
    for f in directory.rglob("*"):
        if f.suffix in (".safetensors", ".bin", ".pt", ".ckpt") and f.is_file():
            weights.setdefault(f.parent, []).append(f)
    if not weights:
        raise GgufError(f"{directory}: no weight files")
    size = 0
    for files in weights.values():
        safe = [f for f in files if f.suffix == ".safetensors"]
        # A variant (``model.fp16.safetensors``) beside the plain file is not what is loaded.
        plain = [f for f in safe if f.name.count(".") == 1]
        size += sum(f.stat().st_size for f in (plain or safe or files))
    channels = 128  # Stable Diffusion's VAE, where the pipeline's own config does not say
    vae_config = directory / "vae" / "config.json"
    if vae_config.is_file():
        with contextlib.suppress(OSError, ValueError, TypeError, IndexError):
            channels = int(json.loads(vae_config.read_text())["block_out_channels"][0])
    activations = LIVE_TENSORS * channels * IMAGE_SIDE * IMAGE_SIDE * 4
    return ModelFacts(
        n_layers=1,
        context_length=0,
        size_bytes=size,
        overhead_bytes=TORCH_RUNTIME_BYTES + activations,
    )


def _mlx_kv_bytes_per_token(config: dict[str, Any], layers: int) -> int:
    """K and V per token in every layer, f16 (what mlx-lm's KV cache holds for these models)."""
    heads = config.get("num_attention_heads")
    hidden = config.get("hidden_size")
    if not isinstance(heads, int) or not isinstance(hidden, int) or heads <= 0:
        return 0
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return int(2 * layers * kv_heads * head_dim * 2)


def _file_type_name(value: Any) -> str | None:
    if not isinstance(value, int):
        return None
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"type{value}"


def _info(path: Path, kv: dict[str, Any], tensor_types: Counter[str], size: int) -> GgufInfo:
    arch = kv.get(Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise GgufError(f"{path}: no general.architecture in the GGUF metadata")

    def get(template: str) -> Any:
        return kv.get(template.format(arch=arch))

    def need_int(template: str) -> int:
        value = get(template)
        if not isinstance(value, int) or value <= 0:
            raise GgufError(f"{path}: no {template.format(arch=arch)} in the GGUF metadata")
        return value

    n_layers = need_int(Keys.LLM.BLOCK_COUNT)
    n_embd = need_int(Keys.LLM.EMBEDDING_LENGTH)
    head_count = get(Keys.Attention.HEAD_COUNT)
    # Some architectures store head counts per layer (an array); KV memory then varies by layer.
    n_head = max(head_count) if isinstance(head_count, list) else head_count
    if not isinstance(n_head, int) or n_head <= 0:
        raise GgufError(f"{path}: no {Keys.Attention.HEAD_COUNT.format(arch=arch)}")
    head_count_kv = get(Keys.Attention.HEAD_COUNT_KV)
    per_layer: list[int] | None = None
    if isinstance(head_count_kv, list) and head_count_kv:
        per_layer = [int(h) for h in head_count_kv]
        n_head_kv = max(per_layer)
    elif isinstance(head_count_kv, int):
        n_head_kv = head_count_kv
    else:
        n_head_kv = n_head  # llama.cpp's default: no grouped-query attention
    # llama.cpp's defaults when the lengths are absent: n_embd / n_head.
    key_length = get(Keys.Attention.KEY_LENGTH) or n_embd // n_head
    value_length = get(Keys.Attention.VALUE_LENGTH) or n_embd // n_head

    tokens = kv.get(Keys.Tokenizer.LIST)
    vocab = get(Keys.LLM.VOCAB_SIZE)
    if not isinstance(vocab, int):
        vocab = tokens.length if isinstance(tokens, SkippedArray) else len(tokens or [])
    template = kv.get(Keys.Tokenizer.CHAT_TEMPLATE)
    name = kv.get(Keys.General.NAME)
    window = get(Keys.Attention.SLIDING_WINDOW)
    return GgufInfo(
        architecture=arch,
        name=name if isinstance(name, str) else None,
        n_layers=n_layers,
        context_length=int(get(Keys.LLM.CONTEXT_LENGTH) or 0),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_head_kv_per_layer=per_layer,
        key_length=int(key_length),
        value_length=int(value_length),
        sliding_window=window if isinstance(window, int) else None,
        vocab_size=vocab,
        chat_template=template if isinstance(template, str) and template.strip() else None,
        file_type=_file_type_name(kv.get(Keys.General.FILE_TYPE)),
        tensor_types=dict(tensor_types.most_common()),
        n_tensors=int(kv["GGUF.tensor_count"]),
        size_bytes=size,
    )
