"""A tiny random-weight Stable Diffusion pipeline in diffusers' layout, built offline: for the
image engine's tests and bench (no image model can be downloaded here).

The real architecture at toy widths, as diffusers' own tests build it: a ``UNet2DConditionModel``
with cross-attention, an ``AutoencoderKL`` of four blocks (so that, as in SD 1.x/2.x, a latent
pixel is 8 x 8 image pixels), a ``CLIPTextModel`` with a CLIP BPE tokenizer whose vocabulary is
written here (characters and a few words), and an Euler scheduler. Saved with
``save_pretrained``: a directory with ``model_index.json`` and one folder per component, which
``StableDiffusionPipeline.from_pretrained`` loads as it loads SD-Turbo. The same arguments
always give the same files (seeded weights).
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

# A few words as whole tokens; every other word is spelt with the characters.
WORDS = ("a", "the", "cat", "dog", "red", "blue", "sea", "photo", "of", "in", "painting")
TEXT_WIDTH = 32


def write_clip_vocabulary(directory: Path) -> Path:
    """``vocab.json`` and ``merges.txt`` of a small CLIP BPE tokenizer: each printable ASCII
    character, alone and word-final (``</w>``), and the ``WORDS``, merged from them."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens = ["<|startoftext|>", "<|endoftext|>"]
    chars = [c for c in string.printable if not c.isspace()]
    tokens += chars + [f"{c}</w>" for c in chars]
    merges: list[str] = []
    for word in WORDS:
        if len(word) < 2:
            continue
        # Left to right: "c a", "ca t</w>".
        left = word[0]
        for i, c in enumerate(word[1:], start=1):
            right = c + ("</w>" if i == len(word) - 1 else "")
            merges.append(f"{left} {right}")
            left += right
            if left not in tokens:
                tokens.append(left)
    vocab = {t: i for i, t in enumerate(tokens)}
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return directory


def make_tiny_diffusion_pipeline(path: Path, *, seed: int = 0) -> Path:
    """Write the pipeline's directory at ``path``; returns it."""
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=TEXT_WIDTH,
        attention_head_dim=4,
        norm_num_groups=4,
    )
    vae = AutoencoderKL(
        block_out_channels=[4, 4, 4, 4],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        latent_channels=4,
        norm_num_groups=2,
        sample_size=256,
    )
    text_config = CLIPTextConfig(
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        hidden_size=TEXT_WIDTH,
        intermediate_size=37,
        layer_norm_eps=1e-05,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=256,
        max_position_embeddings=77,
    )
    text_encoder = CLIPTextModel(text_config)
    with tempfile.TemporaryDirectory() as scratch:
        vocabulary = write_clip_vocabulary(Path(scratch))
        tokenizer = CLIPTokenizer(
            str(vocabulary / "vocab.json"),
            str(vocabulary / "merges.txt"),
            model_max_length=77,
            pad_token="<|endoftext|>",
        )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        timestep_spacing="trailing",
        steps_offset=1,
    )
    pipeline = StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(path, safe_serialization=True)
    return path
