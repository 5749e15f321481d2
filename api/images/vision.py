"""Which models take images: the one place that decides it.

None does yet: no runner reads images (issue 36's engine step, llama.cpp's ``mtmd`` with a
model's projector file, makes this the model's own say, from its card or projection row). Until
then a request with an image is a 400 that says so, in the client's own dialect, rather than an
answer about an image the model never saw.
"""

from __future__ import annotations


def accepts_images(model_id: str) -> bool:
    """Whether ``model_id``'s runners read images."""
    return False


def no_images(model_id: str) -> str:
    """Why a request with an image is refused for ``model_id``."""
    return (
        f"model {model_id} does not accept images: it reads text only (send text, or ask a"
        " vision model)"
    )
