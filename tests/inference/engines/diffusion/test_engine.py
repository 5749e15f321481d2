"""The diffusers image engine on the tiny random-weight Stable Diffusion pipeline: images of the
asked size, the same bytes for the same seed, a step reported after each denoising step,
partial images where asked, and a cancel that stops within a step."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image

from events.records import ImageParams
from inference.engines.diffusion.engine import DiffusersEngine
from inference.image_generation import GenerationCancelled, Progress, partial_steps
from tests.tiny_diffusion import tiny_diffusion_pipeline

PROMPT = "a photo of a red cat"


@pytest.fixture(scope="module")
def engine() -> DiffusersEngine:
    loaded = DiffusersEngine(tiny_diffusion_pipeline(), n_threads=1)
    loaded.load()
    return loaded


def _never() -> bool:
    return False


def _skip(_progress: Progress) -> None:
    pass


def test_images_of_the_asked_size_the_same_seed_the_same_bytes(engine: DiffusersEngine) -> None:
    params = ImageParams(n=2, width=128, height=64, steps=3, seed=7)
    steps: list[Progress] = []
    first = engine.generate(PROMPT, params, steps.append, _never)
    again = engine.generate(PROMPT, params, _skip, _never)
    assert [g.png for g in first] == [g.png for g in again]
    assert first[0].png != first[1].png  # image 1 is drawn with seed 8
    assert [g.seed for g in first] == [7, 8]
    for made in first:
        image = Image.open(io.BytesIO(made.png))
        assert (image.format, image.size) == ("PNG", (128, 64))
        assert (made.width, made.height) == (128, 64)
    assert [(p.image, p.step, p.steps) for p in steps] == [
        (i, s, 3) for i in range(2) for s in (1, 2, 3)
    ]
    assert all(p.partial is None for p in steps)
    alone = engine.generate(PROMPT, params.model_copy(update={"n": 1, "seed": 8}), _skip, _never)
    assert alone[0].png == first[1].png


def test_another_seed_or_prompt_another_image(engine: DiffusersEngine) -> None:
    params = ImageParams(width=64, height=64, steps=2, seed=1)
    one = engine.generate(PROMPT, params, _skip, _never)[0].png
    seeded = engine.generate(PROMPT, params.model_copy(update={"seed": 2}), _skip, _never)
    worded = engine.generate("a blue sea", params, _skip, _never)
    assert len({one, seeded[0].png, worded[0].png}) == 3


def test_partial_images_come_at_the_spread_steps(engine: DiffusersEngine) -> None:
    params = ImageParams(width=64, height=64, steps=4, seed=3, partial_images=2)
    steps: list[Progress] = []
    made = engine.generate(PROMPT, params, steps.append, _never)
    with_partial = [p.step for p in steps if p.partial is not None]
    assert with_partial == sorted(partial_steps(4, 2)) == [2, 3]
    for p in steps:
        if p.partial is not None:
            assert Image.open(io.BytesIO(p.partial)).size == (64, 64)
            assert p.partial != made[0].png


def test_a_cancel_stops_within_a_step(engine: DiffusersEngine) -> None:
    params = ImageParams(n=2, width=64, height=64, steps=10, seed=0)
    seen: list[Progress] = []
    with pytest.raises(GenerationCancelled):
        engine.generate(PROMPT, params, seen.append, lambda: len(seen) >= 3)
    assert [p.step for p in seen] == [1, 2, 3]


def test_sizes_the_model_cannot_make_are_refused_by_name(engine: DiffusersEngine) -> None:
    refused = engine.refusal(ImageParams(width=100, height=64))
    assert refused is not None and "width" in refused and "16" in refused
    assert engine.refusal(ImageParams(width=64, height=48, partial_images=1)) is None


def test_the_pipeline_is_diffusers_layout() -> None:
    path = tiny_diffusion_pipeline()
    assert (path / "model_index.json").is_file()
    weights = {str(f.relative_to(path)) for f in path.rglob("*.safetensors")}
    assert weights == {
        "text_encoder/model.safetensors",
        "unet/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    }


def test_an_engine_not_loaded_says_so(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not loaded"):
        DiffusersEngine(tmp_path).generate(PROMPT, ImageParams(), _skip, _never)


def test_another_thread_gives_the_same_bytes(engine: DiffusersEngine) -> None:
    """The runner loads on one thread and generates on another: the threads PyTorch uses are
    the engine's on each (OpenMP keeps them per thread), so the bytes do not change."""
    params = ImageParams(width=64, height=64, steps=2, seed=4)
    here = engine.generate(PROMPT, params, _skip, _never)[0].png
    with ThreadPoolExecutor(1) as pool:
        there = pool.submit(engine.generate, PROMPT, params, _skip, _never).result()[0].png
    assert there == here
