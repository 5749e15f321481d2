"""The dashboard at ``/``: served without a key, and, in a real browser (Debian's chromium
driven by playwright, nothing downloaded), showing a real two-node cluster live.

Screenshots land in ``$SHOAL_ARTIFACTS`` (default: ``artifacts/`` at the repository root,
which git ignores): ``dashboard-node.png``, ``dashboard-split.png``, ``dashboard-chat.png``,
and ``dashboard-failure.png`` when the browser test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import ConsoleMessage, Page, async_playwright

from harness.hosts import Network
from harness.processes import SHOAL, wait_healthy
from harness.shoal_up import read_until_ready, start, stop
from tests.api.conftest import ApiStack
from tests.cli.shoal_up import KEY, MODEL, REPO

CHROMIUM = os.environ.get("SHOAL_CHROMIUM", "/usr/bin/chromium")
HAVE_CHROMIUM = Path(CHROMIUM).exists()
QUESTION = "What is the capital city of France? Answer in one word."


def _artifacts() -> Path:
    path = Path(os.environ.get("SHOAL_ARTIFACTS", REPO / "artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


async def test_the_page_and_its_files_need_no_key(api_stack: ApiStack) -> None:
    """The page holds no data, so it and its files are served without a key; the API behind
    it still wants one. Neither is in the OpenAPI document."""
    url = api_stack.start_api("keyed", "--api-key", KEY)
    await wait_healthy(url)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        page = await client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'src="static/dashboard.js"' in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assets = {
            "dashboard.js": "javascript",
            "api.js": "javascript",
            "dashboard.css": "text/css",
            "favicon.svg": "image/svg+xml",
        }
        for name, kind in assets.items():
            asset = await client.get(f"/static/{name}")
            assert asset.status_code == 200 and kind in asset.headers["content-type"], name
        missing = await client.get("/static/nope.js")
        assert missing.status_code == 404 and "error" in missing.json()

        assert (await client.get("/v1/state")).status_code == 401
        keyed = await client.get("/v1/state", headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200
        paths = (await client.get("/openapi.json")).json()["paths"]
        assert "/" not in paths and not any(p.startswith("/static") for p in paths)


@pytest.mark.slow
@pytest.mark.parametrize("hosts", [2], indirect=True)
async def test_the_dashboard_shows_a_split_model_and_chats_with_it(
    hosts: Network, tmp_path: Path
) -> None:
    """`shoal up` on one test host and `shoal join` on another (found by the secret), each
    offering 160 MiB: SmolLM2 fits on neither, so it is split over both. The page, opened from
    this machine across the hosts' bridge with the API key typed in, shows the nodes, the
    instance across them, the event feed, a streamed chat answer, a placement preview, and
    deletes the instance."""
    if not HAVE_CHROMIUM:
        pytest.fail(f"no chromium at {CHROMIUM}: `make pytest` installs it, or set SHOAL_CHROMIUM")
    first, second = hosts.hosts
    port = 8000
    env = {"SHOAL_CLUSTER_SECRET": "dashboard-test-secret-0123456789"}
    split = ["--memory-limit", "160M", "--runner-threads", "1"]
    listen = ["--host", "0.0.0.0", "--port", str(port), "--api-key", KEY]
    up = start(
        first.argv([SHOAL, "up", "--data-dir", str(tmp_path / "a"), *listen, *split]), env=env
    )
    joined: subprocess.Popen[str] | None = None
    ready: asyncio.Task[list[str]] | None = None
    lines: list[str] = []
    try:
        assert up.stdout is not None
        async with asyncio.timeout(120):
            while not any("cannot be placed" in line for line in lines):
                line = await asyncio.to_thread(up.stdout.readline)
                if not line:
                    raise RuntimeError("shoal up exited:\n" + "".join(lines))
                lines.append(line)
        joined = start(
            second.argv(
                [SHOAL, "join", "--node-id", "b", "--data-dir", str(tmp_path / "b"), *split]
            ),
            env=env,
        )
        # The model loads while the browser starts.
        ready = asyncio.create_task(read_until_ready(up))
        await _in_the_browser(f"http://{first.address}:{port}", ready)
        lines += await ready
    finally:
        if joined is not None:
            os.killpg(joined.pid, signal.SIGINT)
            joined.wait(60)
        rest = stop(up)
        if ready is not None and not ready.done():
            with contextlib.suppress(Exception):  # it ends with the process it reads
                await ready
        sys.stdout.write("".join(lines)[-3000:] + rest[-3000:])
    assert "stopped" in rest


async def _in_the_browser(url: str, ready: asyncio.Task[list[str]]) -> None:
    artifacts = _artifacts()
    problems: list[str] = []

    def on_console(msg: ConsoleMessage) -> None:
        # The 401s before the key is typed are expected; anything else (a script error, a
        # refused CSP) is a bug.
        if msg.type == "error" and "401" not in msg.text:
            problems.append(msg.text)

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1440, "height": 1000})
        page.on("console", on_console)
        page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
        page.on("dialog", lambda dialog: dialog.accept())  # "Delete instance ...?"
        try:
            await page.goto(url)
            await _with_key(page)
            await _nodes(page, url, artifacts)
            await asyncio.wait_for(asyncio.shield(ready), 120)
            await _split(page, artifacts)
            await _chat(page, artifacts)
            await page.set_viewport_size({"width": 420, "height": 900})  # a phone
            await page.screenshot(path=artifacts / "dashboard-narrow.png", full_page=True)
            await page.set_viewport_size({"width": 1440, "height": 1000})
            await _feed_preview_and_delete(page)
            assert not problems, problems
        except BaseException:
            with contextlib.suppress(Exception):  # the failure itself matters more
                await page.screenshot(path=artifacts / "dashboard-failure.png", full_page=True)
            raise
        finally:
            await browser.close()


async def _with_key(page: Page) -> None:
    """Without the key the page says it needs one; typed in, it is used (and kept)."""
    await page.locator("#banner").get_by_text("API key").wait_for()
    await page.fill("#api-key", KEY)
    await page.click("#key-form button")
    await page.locator("#conn").get_by_text("connected").wait_for()
    assert await page.evaluate("localStorage.getItem('shoal.apiKey')") == KEY


async def _state(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as client:
        state: dict[str, Any] = (await client.get(f"{url}/v1/state")).json()
        return state


async def _nodes(page: Page, url: str, artifacts: Path) -> None:
    nodes = (await _state(url))["nodes"]
    assert nodes
    for node in nodes:
        card = page.locator(f'#nodes .node[data-node-id="{node["node_id"]}"]')
        await card.wait_for()
        text = await card.inner_text()
        assert node["node_id"] in text and node["hostname"] in text
        assert "Memory" in text and "CPU" in text
    await page.screenshot(path=artifacts / "dashboard-node.png", full_page=True)


async def _split(page: Page, artifacts: Path) -> None:
    """The instance drawn across both nodes: two segments of its layer bar, one per node,
    with their runners ready."""
    instance = page.locator("#instances .instance")
    await page.wait_for_function(
        """() => {
            const card = document.querySelector('#instances .instance');
            if (!card) return false;
            const segs = [...card.querySelectorAll('.layer-seg[data-node-id]')];
            const ready = card.querySelectorAll('.shard .pill.good');
            return new Set(segs.map(s => s.dataset.nodeId)).size === 2 && ready.length === 2;
        }""",
        timeout=30_000,
    )
    text = await instance.inner_text()
    assert "split over 2 nodes" in text and MODEL in text
    assert re.search(r"layers 0\u2013\d+ on", text) and " on b / cpu" in text
    await page.screenshot(path=artifacts / "dashboard-split.png", full_page=True)


async def _chat(page: Page, artifacts: Path) -> None:
    """The answer appears piece by piece, as the tokens come."""
    await page.select_option("#chat-model", MODEL)
    await page.fill("#chat-temp", "0")
    await page.fill("#chat-max", "12")
    await page.fill("#chat-input", QUESTION)
    # Every text the reply shows on its way, to see it grow.
    await page.evaluate(
        """() => {
            window.seen = [];
            new MutationObserver(() => {
                const reply = document.querySelector('#chat-log .msg.assistant .msg-text');
                const text = reply ? reply.textContent : '';
                if (text && text !== window.seen.at(-1)) window.seen.push(text);
            }).observe(document.getElementById('chat-log'),
                       {childList: true, subtree: true, characterData: true});
        }"""
    )
    await page.click("#chat-send")
    await page.locator("#chat-log .msg.assistant .msg-meta").wait_for(timeout=60_000)
    reply = await page.inner_text("#chat-log .msg.assistant .msg-text")
    assert "Paris" in reply
    seen: list[str] = await page.evaluate("window.seen")
    assert len(seen) >= 2 and seen[-1].strip() == reply.strip(), seen
    # The task's line in the recent tasks (the state, read again on TaskCompleted).
    await page.locator("#tasks .pill.good").get_by_text("completed").wait_for(timeout=10_000)
    # In the dark theme, which follows the system's.
    await page.emulate_media(color_scheme="dark")
    await page.screenshot(path=artifacts / "dashboard-chat.png", full_page=True)


async def _feed_preview_and_delete(page: Page) -> None:
    # The feed shows the log live: the runners starting, the chat's task.
    for kind in ("RunnerStateChanged", "TaskCompleted"):
        await page.locator(f'#events .ev[data-type="{kind}"]').first.wait_for(timeout=10_000)
    # The form previews where another instance would go (both nodes are full: nowhere).
    await page.click("#req-preview")
    await page.locator("#req-result .preview").wait_for()
    assert "Cannot be placed now" in await page.inner_text("#req-result")
    await page.click("#instances .instance button.danger")
    await page.locator("#instances").get_by_text("No instance").wait_for(timeout=30_000)
