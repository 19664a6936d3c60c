"""Headless Chromium for tests and benchmarks, driven over the DevTools protocol on a pipe, stdlib only.

``--remote-debugging-pipe`` makes Chromium read commands on fd 3 and write replies and events on fd 4, each a
JSON message ending in a NUL byte. ``Chromium`` opens one tab, loads a page, records what a test must see
(console messages, uncaught exceptions, log entries, every network request and every failed one), evaluates
JavaScript and takes screenshots. Every wait has a deadline; the browser is killed on close whatever happens.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
         "--disable-extensions", "--disable-default-apps", "--mute-audio", "--hide-scrollbars",
         "--remote-debugging-pipe")


def find_chromium() -> str | None:
    """$CHROMIUM, else the first of the usual names on PATH, else Debian's /usr/bin/chromium."""
    for candidate in (os.environ.get("CHROMIUM"), *NAMES):
        found = candidate and shutil.which(candidate)
        if found:
            return found
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless Chromium with one tab; use as a context manager."""

    def __init__(self, executable: str, timeout: float = 30.0):
        self.timeout = timeout
        self.events: list[dict] = []
        self._id, self._buffer = 0, b""
        self._profile = tempfile.mkdtemp(prefix="xprep-chromium-")
        commands_in, self._commands = os.pipe()
        self._replies, replies_out = os.pipe()

        def on_fds_3_and_4():  # in the child, before exec: the pipe ends where --remote-debugging-pipe looks
            # via copies above 100 first: a pipe end may itself be fd 3 or 4, and dup2 onto itself would keep
            # it close-on-exec
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in (commands_in, replies_out)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        # close_fds=False: the fds Python opens are not inheritable anyway; 3 and 4 (made by dup2) are
        self.proc = subprocess.Popen([executable, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     preexec_fn=on_fds_3_and_4, close_fds=False)
        os.close(commands_in)
        os.close(replies_out)
        self.session = None
        try:
            target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                self.send(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------- protocol
    def send(self, method: str, params: dict | None = None, timeout: float | None = None) -> dict:
        """One command (on the tab once attached); events that arrive meanwhile are kept in ``events``."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if self.session and not method.startswith("Target."):
            message["sessionId"] = self.session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._commands, data):]
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._next(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float | None = None) -> dict:
        """The next event ``method`` (an earlier one already received counts once)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        for k, event in enumerate(self.events):
            if event.get("method") == method and not event.get("_seen"):
                self.events[k]["_seen"] = True
                return event
        while True:
            event = self._next(deadline)
            self.events.append(event)
            if event.get("method") == method:
                event["_seen"] = True
                return event

    def _next(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"Chromium did not answer within {self.timeout:.0f} s")
            ready, _, _ = select.select([self._replies], [], [], left)
            if ready:
                chunk = os.read(self._replies, 1 << 20)
                if not chunk:
                    raise BrowserError(f"Chromium exited: {self._stderr_tail()}")
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def _stderr_tail(self) -> str:
        try:
            self.proc.wait(timeout=5)
            return (self.proc.stderr.read() or b"").decode(errors="replace")[-2000:]
        except subprocess.TimeoutExpired:
            return "(still running)"

    # -------------------------------------------------------------------------------------- the tab
    def open(self, url: str, width: int = 1280, height: int = 900) -> float:
        """Load ``url`` at a window of ``width`` × ``height`` CSS pixels; seconds until the load event and two
        animation frames after it (the page laid out and painted)."""
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        start = time.perf_counter()
        self.send("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired")
        self.evaluate("new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))", True)
        return time.perf_counter() - start

    def evaluate(self, expression: str, await_promise: bool = False):
        """The JSON value of a JavaScript expression in the page; an exception in it is a BrowserError."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": await_promise})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}…: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, full_page: bool = True) -> bytes:
        """A PNG of the viewport, or of the whole page."""
        params = {"format": "png"}
        if full_page:
            size = self.send("Page.getLayoutMetrics")["cssContentSize"]
            params |= {"captureBeyondViewport": True,
                       "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}}
        return base64.b64decode(self.send("Page.captureScreenshot", params)["data"])

    def problems(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions, error log entries, failed requests, and any request
        for something other than the page's own file (a self-contained page fetches nothing)."""
        out = []
        for e in self.events:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(f"console {p['type']}: {[a.get('value', a.get('description')) for a in p['args']]}")
            elif method == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails']}")
            elif method == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
                out.append(f"log {p['entry']['level']}: {p['entry'].get('text')} {p['entry'].get('url', '')}")
            elif method == "Network.loadingFailed":
                out.append(f"failed request: {p.get('errorText')} {p.get('requestId')}")
            elif method == "Network.requestWillBeSent" and not p["request"]["url"].startswith(("file:", "about:")):
                out.append(f"network request: {p['request']['url']}")
        return out

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    # --------------------------------------------------------------------------------------- close
    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for fd in (self._commands, self._replies):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.proc.stderr:
            self.proc.stderr.close()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


PIXELS_JS = """
(async (b64) => {
  const img = new Image();
  img.src = "data:image/png;base64," + b64;
  await img.decode();
  const canvas = document.createElement("canvas");
  canvas.width = img.width; canvas.height = img.height;
  const ctx = canvas.getContext("2d");
  ctx.drawImage(img, 0, 0);
  const px = ctx.getImageData(0, 0, img.width, img.height).data;
  const colours = new Set();
  let differ = 0;
  for (let k = 0; k < px.length; k += 4) {
    colours.add((px[k] >> 3) << 10 | (px[k + 1] >> 3) << 5 | (px[k + 2] >> 3));
    if (px[k] !== px[0] || px[k + 1] !== px[1] || px[k + 2] !== px[2]) differ += 1;
  }
  return {width: img.width, height: img.height, colours: colours.size, share: differ / (px.length / 4)};
})
"""


def pixel_summary(browser: Chromium, png: bytes) -> dict:
    """Decode a PNG in a blank tab: its size, how many distinct colours (5 bits a channel) and the share of
    pixels unlike the top-left one (a blank image has one colour and a share of 0)."""
    browser.send("Page.navigate", {"url": "about:blank"})
    browser.wait_for("Page.loadEventFired")
    return browser.evaluate(f"{PIXELS_JS}({json.dumps(base64.b64encode(png).decode())})", await_promise=True)


def file_url(path: str | Path) -> str:
    return Path(path).resolve().as_uri()
