"""Claude Code and Codex as installed from the npm registry (``make clients``: the versions in
``tests/clients/package.json``), run non-interactively as their docs say to point them at a
local server, each in a home of its own (no user settings, no updates, no telemetry)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import tempfile
from pathlib import Path

PACKAGE = Path(__file__).with_name("package.json")
# The word a prompt asks the shell to echo: the tool round trip's mark.
TOOL_WORD = "shoal-tool-ok"
CLAUDE_TOOL_PROMPT = f"Use the Bash tool to run this command: echo {TOOL_WORD}"
CODEX_TOOL_PROMPT = f"Run this shell command: echo {TOOL_WORD}"


def clients_dir() -> Path:
    """Where ``make clients`` installed them: a directory per content of package.json (the
    Makefile computes the same key), or ``SHOAL_CLIENTS_DIR``."""
    if (given := os.environ.get("SHOAL_CLIENTS_DIR")) is not None:
        return Path(given)
    key = hashlib.sha256(PACKAGE.read_bytes()).hexdigest()[:16]
    return Path.home() / ".cache" / "shoal" / "clients" / key


def binary(name: str) -> Path:
    path = clients_dir() / "node_modules" / ".bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make clients` (npm) first")
    return path


def _home() -> Path:
    return Path(tempfile.mkdtemp(prefix="shoal-client-"))


def _env(home: Path, extra: dict[str, str]) -> dict[str, str]:
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    return keep | {"HOME": str(home), "NO_COLOR": "1"} | extra


def _run(
    argv: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``argv`` run to its end; after ``timeout``, its whole process group is killed (the npm
    packages start their native binary as a child: killing the wrapper alone would leave it
    connected, reading the answer) and ``TimeoutExpired`` raised with what it wrote."""
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def claude(
    base_url: str,
    model: str,
    prompt: str,
    timeout: float,
    *extra: str,
    key: str = "dummy",
    quiet: bool = True,
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``claude -p PROMPT`` against ``base_url`` (Anthropic's, without ``/v1``), its every
    model (the main one, the small fast one) ``model``; JSON output; Bash allowed. ``quiet``:
    without its calls besides the conversation (``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``)."""
    home = _home()
    quieted = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"} if quiet else {}
    env = _env(
        home,
        quieted
        | {
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": key,
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }
        | (env_extra or {}),
    )
    argv = [str(binary("claude")), "-p", prompt, "--output-format", "json"]
    argv += ["--allowedTools", "Bash", "--max-turns", "3", *extra]
    return _run(argv, env, home, timeout)


def codex(
    base_url: str, model: str, prompt: str, timeout: float, *extra: str, key: str = "dummy"
) -> subprocess.CompletedProcess[str]:
    """``codex exec PROMPT`` with a ``model_providers`` entry for ``base_url`` (with
    ``/v1``), ``wire_api = "responses"``, as its docs say for a local server; JSON events
    out; commands run without approval or sandbox (the test's own directory)."""
    home = _home()
    codex_home = home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        f'model = "{model}"\n'
        'model_provider = "shoal"\n'
        "[model_providers.shoal]\n"
        'name = "Shoal"\n'
        f'base_url = "{base_url}"\n'
        'wire_api = "responses"\n'
        'env_key = "SHOAL_API_KEY"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
    )
    env = _env(home, {"CODEX_HOME": str(codex_home), "SHOAL_API_KEY": key})
    argv = [str(binary("codex")), "exec", "--json", "--skip-git-repo-check"]
    argv += ["--dangerously-bypass-approvals-and-sandbox", *extra, prompt]
    return _run(argv, env, home, timeout)
