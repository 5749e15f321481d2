"""Searching the Hugging Face Hub for models Shoal can run: repositories with GGUF files, or
MLX conversions. Offline, or with the Hub out of reach, one clear error rather than retries."""

from __future__ import annotations

from huggingface_hub import HfApi
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from pydantic import BaseModel, ConfigDict

from services.models.resolve import unreachable


class HubUnavailable(RuntimeError):
    """The Hub cannot be searched from here; the message says why."""


class HubModel(BaseModel):
    model_config = ConfigDict(frozen=True)

    repo: str
    downloads: int = 0
    likes: int = 0
    gguf: bool = False
    mlx: bool = False

    def add_command(self) -> str:
        """How to add it (a GGUF repository needs one of its files named)."""
        name = self.repo.rsplit("/", 1)[-1].lower().removesuffix("-gguf")
        if self.mlx and not self.gguf:
            return f"shoal models add {name} --hf {self.repo} --engine mlx"
        return f"shoal models add {name} --hf {self.repo} --file FILE.gguf"


def search_hub(
    text: str, *, mlx: bool = False, limit: int = 20, endpoint: str | None = None
) -> list[HubModel]:
    """Repositories matching ``text``, most downloaded first: with GGUF files, or (``mlx``)
    MLX conversions."""
    if hf_constants.HF_HUB_OFFLINE:
        raise HubUnavailable("cannot search the Hugging Face Hub: HF_HUB_OFFLINE is set")
    why = unreachable(endpoint or hf_constants.ENDPOINT)
    if why:
        raise HubUnavailable(f"cannot search the Hugging Face Hub: {why}")
    api = HfApi(endpoint=endpoint)
    try:
        found = api.list_models(
            search=text, filter="mlx" if mlx else "gguf", sort="downloads", limit=limit
        )
        out = []
        for m in found:
            tags = set(m.tags or [])
            out.append(
                HubModel(
                    repo=m.id,
                    downloads=m.downloads or 0,
                    likes=m.likes or 0,
                    gguf="gguf" in tags,
                    mlx="mlx" in tags,
                )
            )
        return out
    except OfflineModeIsEnabled as exc:
        raise HubUnavailable("cannot search the Hugging Face Hub: offline mode") from exc
    except (HfHubHTTPError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HubUnavailable(f"cannot search the Hugging Face Hub: {first}") from exc
