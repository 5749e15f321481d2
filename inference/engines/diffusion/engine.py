"""The image engine on diffusers (PyTorch): a pipeline directory in diffusers' layout
(``model_index.json`` and a folder per component: SD-Turbo, SDXL-Turbo, FLUX.1-schnell), loaded
with ``DiffusionPipeline.from_pretrained``, on the CPU (CUDA where torch has it and the shard
was placed on a GPU).

Progress, partial images and cancellation go through diffusers' ``callback_on_step_end``,
which every text-to-image pipeline of theirs calls after each denoising step: there the engine
reports the step, decodes a partial image where one was asked for (the latents so far through
the VAE: Stable Diffusion's 4-channel latents), and raises ``GenerationCancelled`` once the
task is cancelled, so that a cancel stops generation within a step."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from events.records import ImageParams
from inference.image_generation import (
    GeneratedImage,
    GenerationCancelled,
    OnStep,
    Progress,
    partial_steps,
    seed_of,
)

log = logging.getLogger(__name__)

# Steps for a task that names none: the turbo models Shoal's catalogue lists make an image in
# 1-4 steps (and look worse with many more); a model that wants more is asked for them.
DEFAULT_STEPS = 4


def png_bytes(image: Any) -> bytes:
    """A PIL image as PNG (the same pixels give the same bytes)."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class DiffusersEngine:
    """One diffusers pipeline, generating one image at a time."""

    def __init__(
        self,
        path: Path,
        *,
        n_threads: int | None = None,
        device: str = "cpu",
        default_steps: int = DEFAULT_STEPS,
    ) -> None:
        self._path = path
        self._n_threads = n_threads
        self._device = device
        self._default_steps = default_steps
        self._pipeline: Any = None

    @property
    def default_steps(self) -> int:
        return self._default_steps

    def load(self) -> None:
        from diffusers import DiffusionPipeline

        self._use_threads()
        pipeline = DiffusionPipeline.from_pretrained(str(self._path))
        pipeline.set_progress_bar_config(disable=True)
        self._pipeline = pipeline.to(self._device)

    def _use_threads(self) -> None:
        """PyTorch's CPU threads, set on the calling thread: OpenMP keeps the count per thread
        (the runner loads on one thread and generates on another), and the count changes the
        sums' order, so the bytes: the same seed gives the same image at the same count."""
        import torch

        if self._n_threads is not None and torch.get_num_threads() != self._n_threads:
            torch.set_num_threads(self._n_threads)

    def unload(self) -> None:
        self._pipeline = None

    @property
    def _scale(self) -> int:
        """Image pixels per latent pixel, on each side (8 for Stable Diffusion's VAE)."""
        return int(getattr(self._pipeline, "vae_scale_factor", 8))

    def refusal(self, params: ImageParams) -> str | None:
        multiple = self._scale * 2  # the UNet halves the latent at least once
        wrong = [
            name
            for name, side in (("width", params.width), ("height", params.height))
            if side % multiple
        ]
        if wrong:
            return (
                f"size {params.width}x{params.height}: this model makes images whose sides are"
                f" multiples of {multiple} ({' and '.join(wrong)} are not)"
            )
        if params.partial_images and not self._decodes_latents():
            return "partial_images: this model's pipeline cannot show its latents"
        return None

    def _decodes_latents(self) -> bool:
        return hasattr(self._pipeline, "vae") and hasattr(self._pipeline, "image_processor")

    def generate(
        self,
        prompt: str,
        params: ImageParams,
        on_step: OnStep,
        cancelled: Callable[[], bool],
    ) -> list[GeneratedImage]:
        if self._pipeline is None:
            raise RuntimeError("the image engine is not loaded")
        self._use_threads()
        steps = params.steps or self._default_steps
        return [self._one(prompt, params, i, steps, on_step, cancelled) for i in range(params.n)]

    def _one(
        self,
        prompt: str,
        params: ImageParams,
        index: int,
        steps: int,
        on_step: OnStep,
        cancelled: Callable[[], bool],
    ) -> GeneratedImage:
        import torch

        pipeline = self._pipeline
        partials = partial_steps(steps, params.partial_images)

        def after_step(_pipe: Any, i: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            step = i + 1
            partial = None
            if step in partials and step < steps:
                partial = self._preview(kwargs["latents"])
            on_step(Progress(index, params.n, step, steps, partial))
            if cancelled():
                raise GenerationCancelled(f"cancelled after step {step} of {steps}")
            return kwargs

        if cancelled():
            raise GenerationCancelled("cancelled before it started")
        seed = seed_of(params, index)
        asked: dict[str, Any] = {
            "prompt": prompt,
            "width": params.width,
            "height": params.height,
            "num_inference_steps": steps,
            "generator": torch.Generator("cpu").manual_seed(seed),
            "callback_on_step_end": after_step,
            "output_type": "pil",
        }
        if params.guidance is not None:
            asked["guidance_scale"] = params.guidance
        if params.negative_prompt is not None:
            asked["negative_prompt"] = params.negative_prompt
        with torch.inference_mode():
            image = pipeline(**asked).images[0]
        return GeneratedImage(index, png_bytes(image), image.width, image.height, seed)

    def _preview(self, latents: Any) -> bytes:
        """The image the latents so far decode to (what OpenAI's partial images show)."""
        pipeline = self._pipeline
        vae = pipeline.vae
        decoded = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
        image = pipeline.image_processor.postprocess(decoded, output_type="pil")[0]
        return png_bytes(image)
