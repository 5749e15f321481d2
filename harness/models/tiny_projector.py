"""A multimodal projector ("mmproj") GGUF for the test model, with random weights, written with
the ``gguf`` package: what lets SmolLM2-135M-Instruct "read" images in the tests. No real
vision model is run anywhere in the tests: this projector turns an image into 64 embeddings
that depend on its pixels, and no more (its answers about an image mean nothing).

The projector is of type ``mlp`` (LLaVA-1.5: a CLIP ViT and a two-layer MLP), the one that
fits SmolLM2: it adds no text tokens of its own (``idefics3``, SmolVLM's, looks up
``<fake_token_around_image>`` and ``<global-img>``, which SmolLM2's vocabulary lacks, and
libmtmd aborts), and without ``image_grid_pinpoints`` it resizes every image to one tile:
one image, one chunk of (image_size / patch_size)^2 = 64 tokens. Its output is 576 wide,
SmolLM2's embedding (``mtmd_init_from_file`` refuses another). Every key has libmtmd's type
(``gguf_get_val_u32`` and the like abort the process on another); numpy shapes are ggml's
``ne`` reversed.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

# SmolLM2-135M's embedding width: the projector's output.
SMOLLM2_EMBD = 576
IMAGE_SIZE = 64
PATCH_SIZE = 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2

Array = npt.NDArray[np.float32]


def write_tiny_projector(
    path: Path,
    *,
    n_embd: int = 32,
    n_head: int = 4,
    n_ff: int = 64,
    n_layer: int = 2,
    mm_hidden: int = 64,
    seed: int = 0,
) -> Path:
    """Write the projector to ``path`` (about 260 kB) and return it. ``n_ff`` must not be
    ``n_embd``: clip.cpp swaps a block's up and down weights when they look the wrong way."""
    rng = np.random.default_rng(seed)
    n_patches = IMAGE_TOKENS

    def linear(n_out: int, n_in: int) -> Array:
        values: Array = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
        return values

    def small(n: int) -> Array:
        values: Array = (rng.standard_normal(n) * 0.02).astype(np.float32)
        return values

    tensors: dict[str, Array] = {
        # ggml ne [patch, patch, 3, n_embd]: the patches' convolution
        "v.patch_embd.weight": (
            rng.standard_normal((n_embd, 3, PATCH_SIZE, PATCH_SIZE)) / np.sqrt(3 * PATCH_SIZE**2)
        ).astype(np.float32),
        "v.patch_embd.bias": small(n_embd),
        "v.position_embd.weight": (rng.standard_normal((n_patches, n_embd)) * 0.1).astype(
            np.float32
        ),
        "v.pre_ln.weight": np.ones(n_embd, np.float32),
        "v.pre_ln.bias": np.zeros(n_embd, np.float32),
    }
    # LLaVA reads the penultimate block's output, but the loader wants every block.
    for i in range(n_layer):
        block = f"v.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors[f"{block}.{name}.weight"] = linear(n_embd, n_embd)
            tensors[f"{block}.{name}.bias"] = small(n_embd)
        for norm in ("ln1", "ln2"):
            tensors[f"{block}.{norm}.weight"] = np.ones(n_embd, np.float32)
            tensors[f"{block}.{norm}.bias"] = np.zeros(n_embd, np.float32)
        tensors[f"{block}.ffn_up.weight"] = linear(n_ff, n_embd)
        tensors[f"{block}.ffn_up.bias"] = small(n_ff)
        tensors[f"{block}.ffn_down.weight"] = linear(n_embd, n_ff)
        tensors[f"{block}.ffn_down.bias"] = small(n_embd)
    # The MLP: the output width is mm.2's (the text model's embedding).
    tensors["mm.0.weight"] = linear(mm_hidden, n_embd)
    tensors["mm.0.bias"] = np.zeros(mm_hidden, np.float32)
    tensors["mm.2.weight"] = linear(SMOLLM2_EMBD, mm_hidden)
    tensors["mm.2.bias"] = np.zeros(SMOLLM2_EMBD, np.float32)

    writer = gguf.GGUFWriter(str(path), arch="clip")
    writer.add_string("general.name", "shoal-tiny-mlp-mmproj")
    writer.add_string("general.description", "random weights, for tests only")
    writer.add_uint32("general.file_type", 0)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_audio_encoder", False)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.embedding_length", n_embd)
    writer.add_uint32("clip.vision.feed_forward_length", n_ff)
    writer.add_uint32("clip.vision.block_count", n_layer)
    writer.add_uint32("clip.vision.attention.head_count", n_head)
    writer.add_uint32("clip.vision.projection_dim", SMOLLM2_EMBD)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
