"""Open a local HTML file in headless Chromium (Debian's /usr/bin/chromium) and read back what the
browser made of it — title, headings, every <img> (loaded or not) and every URL the page requested —
over the Chrome DevTools Protocol. No new dependencies: the protocol's websocket is aiohttp's.

    page = open_page("/path/report.html")        # -> Page
    broken_images(page)                          # -> the <img>s the browser could not show

Chromium runs in its own process group with a throw-away profile and is ended by that group's id
(never by name). Every wait has a timeout whose message names the peer (`chromium at port N`).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

CHROMIUM = "/usr/bin/chromium"
SETUP_HINT = "run `bash scripts/setup.sh` (it installs Debian's chromium package with apt-get)"

# For each <img>: its src attribute as written, what the browser resolved it to, and whether it decoded.
_PAGE_JS = """JSON.stringify({
  title: document.title,
  headings: Array.from(document.querySelectorAll('h1, h2'), h => ({tag: h.tagName.toLowerCase(),
                                                                  text: h.textContent.trim()})),
  images: Array.from(document.images, i => ({src: i.getAttribute('src') || '', current_src: i.currentSrc,
    alt: i.getAttribute('alt') || '', file: i.getAttribute('data-file'), complete: i.complete,
    natural_width: i.naturalWidth, natural_height: i.naturalHeight}))
})"""


class ChromiumMissing(RuntimeError):
    pass


@dataclass
class Image:
    src: str  # the attribute as written in the HTML
    current_src: str  # the URL the browser resolved it to
    alt: str
    file: str | None  # data-file: the PNG beside the report this image is a copy of
    complete: bool
    natural_width: int
    natural_height: int

    @property
    def loaded(self) -> bool:
        return self.complete and self.natural_width > 0 and self.natural_height > 0

    def short(self) -> str:
        src = self.src if len(self.src) <= 60 else self.src[:50] + f"…({len(self.src)} chars)"
        return (f"<img alt={self.alt!r} src={src!r} data-file={self.file!r}: complete={self.complete} "
                f"{self.natural_width}x{self.natural_height}>")


@dataclass
class Page:
    url: str
    title: str
    headings: list[dict]
    images: list[Image]
    requests: list[str] = field(default_factory=list)  # every URL the page asked for (Network domain)


def broken_images(page: Page) -> list[Image]:
    return [i for i in page.images if not i.loaded]


class Chromium:
    """`/usr/bin/chromium --headless=new` on a free DevTools port, in its own process group."""

    def __init__(self, binary: str = CHROMIUM, start_timeout: float = 45.0):
        if not os.path.exists(binary):
            raise ChromiumMissing(f"{binary} is missing: {SETUP_HINT}")
        self.binary, self.start_timeout = binary, start_timeout
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._tmp = tempfile.mkdtemp(prefix="areal_like-chromium-")
        self.profile = os.path.join(self._tmp, "profile")
        self.log_path = os.path.join(self._tmp, "chromium.log")

    @property
    def peer(self) -> str:
        return f"chromium at port {self.port}" if self.port else f"chromium ({self.binary})"

    def log_tail(self, n: int = 3000) -> str:
        try:
            return pathlib.Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def start(self) -> "Chromium":
        os.makedirs(self.profile)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                 "--disable-dev-shm-usage", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                 f"--user-data-dir={self.profile}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.peer} exited with code {self.proc.returncode} before opening its "
                                   f"DevTools port; its output:\n{self.log_tail()}")
            try:
                first = pathlib.Path(port_file).read_text().splitlines()[0].strip()
                if first.isdigit():
                    self.port = int(first)
                    return self
            except (OSError, IndexError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.peer}: no {port_file} within {self.start_timeout:.0f}s; its output:\n"
                           f"{self.log_tail()}")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the group we started (start_new_session)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:  # helpers (zygote, renderers) left in the group after the browser process exited
                os.killpg(self.proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:  # until the group is gone (signal 0: existence check)
                    os.killpg(self.proc.pid, 0)
                    time.sleep(0.05)
            except (ProcessLookupError, PermissionError):
                pass
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "Chromium":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self, path: str, timeout: float = 30.0) -> Page:
        return asyncio.run(_open(self, pathlib.Path(path).resolve().as_uri(), timeout))


class _Cdp:
    """Commands and events on one DevTools websocket (events kept in arrival order)."""

    def __init__(self, ws, peer: str):
        self.ws, self.peer, self.next_id, self.events = ws, peer, 0, []

    async def _receive(self, what: str, deadline: float) -> dict:
        import aiohttp

        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{self.peer}: {what}: timed out")
        try:
            msg = await asyncio.wait_for(self.ws.receive(), left)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{self.peer}: {what}: timed out") from None
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise ConnectionError(f"{self.peer}: DevTools websocket gave {msg.type.name} while waiting for {what}")
        return json.loads(msg.data)

    async def call(self, method: str, timeout: float = 10.0, **params) -> dict:
        self.next_id += 1
        mid = self.next_id
        await self.ws.send_json({"id": mid, "method": method, "params": params})
        deadline = time.monotonic() + timeout
        while True:
            data = await self._receive(f"no reply to {method} within {timeout:.0f}s", deadline)
            if data.get("id") == mid:
                if "error" in data:
                    raise RuntimeError(f"{self.peer}: {method} failed: {data['error']}")
                return data.get("result", {})
            if "method" in data:
                self.events.append(data)

    async def wait_event(self, name: str, timeout: float, what: str = "") -> dict:
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for ev in self.events[seen:]:
                if ev["method"] == name:
                    return ev
            seen = len(self.events)
            data = await self._receive(f"no {name} within {timeout:.0f}s{what}", deadline)
            if "method" in data:
                self.events.append(data)


async def _open(chrome: Chromium, url: str, timeout: float) -> Page:
    import aiohttp

    peer = chrome.peer
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=client_timeout) as http:
        try:
            async with http.get(f"http://127.0.0.1:{chrome.port}/json/list") as resp:
                targets = await resp.json(content_type=None)
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise ConnectionError(f"{peer}: GET /json/list failed: {type(e).__name__}: {e}") from None
        pages = [t for t in targets if t.get("type") == "page" and t.get("webSocketDebuggerUrl")]
        if not pages:
            raise RuntimeError(f"{peer}: no page target in /json/list: {targets}")
        try:
            ws = await asyncio.wait_for(http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0), timeout)
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise ConnectionError(f"{peer}: DevTools websocket connect failed: {type(e).__name__}: {e}") from None
        async with ws:
            cdp = _Cdp(ws, peer)
            await cdp.call("Page.enable")
            await cdp.call("Network.enable")
            nav = await cdp.call("Page.navigate", timeout, url=url)
            if nav.get("errorText"):
                raise RuntimeError(f"{peer}: navigating to {url} failed: {nav['errorText']}")
            await cdp.wait_event("Page.loadEventFired", timeout, f" after navigating to {url}")
            res = await cdp.call("Runtime.evaluate", timeout, expression=_PAGE_JS, returnByValue=True)
            if "exceptionDetails" in res:
                raise RuntimeError(f"{peer}: the page script failed: {res['exceptionDetails']}")
            data = json.loads(res["result"]["value"])
            requests = [ev["params"]["request"]["url"] for ev in cdp.events
                        if ev["method"] == "Network.requestWillBeSent"]
    return Page(url=url, title=data["title"], headings=data["headings"],
                images=[Image(**i) for i in data["images"]], requests=requests)


def open_page(path: str, timeout: float = 30.0) -> Page:
    """Start Chromium, load `path` (a local file) and return what it shows; Chromium is ended after."""
    with Chromium() as chrome:
        return chrome.open(path, timeout)
