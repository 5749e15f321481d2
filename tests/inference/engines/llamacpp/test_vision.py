"""Where the llama.cpp engine's projector goes (pure). Images through the engine in-process
(libmtmd) are every engine's contract: ``contract/test_images.py``."""

from __future__ import annotations

from inference.engines.llamacpp.vision import projector_on_gpu


def test_the_projector_goes_where_the_model_s_layers_are() -> None:
    assert not projector_on_gpu({"n_gpu_layers": 0, "split_mode": 0, "main_gpu": -1})
    assert projector_on_gpu({"n_gpu_layers": 31, "split_mode": 0, "main_gpu": 0})
    assert projector_on_gpu({"n_gpu_layers": 10, "split_mode": 1, "main_gpu": 0})  # some in RAM
    assert not projector_on_gpu({})  # Llama's defaults: the CPU
