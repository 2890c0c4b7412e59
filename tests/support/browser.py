"""A real browser for the job page's tests: Debian's headless Chromium, driven by Selenium.

* The driver is named (``$PSLAUNCH_CHROMEDRIVER``, default /usr/bin/chromedriver) and
  ``SE_OFFLINE=true`` is set, so Selenium Manager never looks for a driver on the network.
* Chromium keeps its console (``goog:loggingPrefs`` browser ALL: CSP violations land there) and
  its DevTools network events (performance log): :meth:`Browser.requests` lists every URL the
  page asked for, so a test can prove that nothing outside the job's server was loaded.
* Each test keeps screenshots under ``$PSLAUNCH_TEST_ARTIFACTS`` (default ``test-artifacts/`` in
  the repository, git-ignored), in a folder named after the test: :meth:`Browser.shot` on demand,
  and one at teardown, whatever the outcome. We look at them.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

from support.helpers import REPO

WINDOW = (1400, 1000)
CHROMIUM = os.environ.get("PSLAUNCH_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("PSLAUNCH_CHROMEDRIVER", "/usr/bin/chromedriver")
#: Chromium's own background traffic (updates, sync, metrics, field trials) off: the tests account
#: for every request, and the machine must not talk to anything but loopback
QUIET_FLAGS = (
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--no-first-run", "--no-default-browser-check",
    "--metrics-recording-only", "--disable-domain-reliability", "--disable-client-side-phishing-detection",
    "--disable-features=OptimizationHints,MediaRouter,Translate,AutofillServerCommunication",
    "--disable-dev-shm-usage", "--disable-gpu",
)


def artifacts_dir(nodeid: str) -> Path:
    """The folder of one test's screenshots and logs: ``$PSLAUNCH_TEST_ARTIFACTS/<test id>``
    (made empty, so what is there belongs to the last run)."""
    root = Path(os.environ.get("PSLAUNCH_TEST_ARTIFACTS") or REPO / "test-artifacts")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid.split("/")[-1].replace("::", "__")).strip("_")
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def missing() -> Optional[str]:
    """Why no browser can run here (a one-line reason with the fix), or None."""
    for path, what in ((CHROMIUM, "PSLAUNCH_CHROMIUM"), (CHROMEDRIVER, "PSLAUNCH_CHROMEDRIVER")):
        if not os.access(path, os.X_OK):
            return f"{path} not found (run scripts/deps/25-chromium.sh or set {what})"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (scripts/setup.sh installs the test extra)"
    return None


class Browser:
    """One headless Chromium window; its console and network requests accumulate across reads."""

    def __init__(self, out: Path) -> None:
        os.environ["SE_OFFLINE"] = "true"
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        opts.add_argument("--headless=new")
        if os.geteuid() == 0:
            opts.add_argument("--no-sandbox")  # Chromium refuses to run its sandbox as root
        opts.add_argument(f"--window-size={WINDOW[0]},{WINDOW[1]}")
        for flag in QUIET_FLAGS:
            opts.add_argument(flag)
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
        self.out = out
        self._console: list[dict] = []
        self._requests: list[dict] = []
        self._shots = 0
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER, log_output=str(out / "chromedriver.log")),
                                       options=opts)
        self.driver.set_page_load_timeout(30)
        self.driver.execute_cdp_cmd("Network.enable", {})

    # --- what the page did ---------------------------------------------------------------------

    def _drain(self) -> None:
        self._console += self.driver.get_log("browser")
        for entry in self.driver.get_log("performance"):
            msg = json.loads(entry["message"])["message"]
            if msg.get("method") == "Network.requestWillBeSent":
                req = msg["params"]["request"]
                self._requests.append({"url": req["url"], "method": req["method"], "headers": req.get("headers", {}),
                                       "type": msg["params"].get("type")})

    def console(self) -> list[dict]:
        """Every console entry so far (``{"level", "message", "source"}``)."""
        self._drain()
        return list(self._console)

    def csp_violations(self) -> list[str]:
        """Console messages that report a Content-Security-Policy violation."""
        return [e["message"] for e in self.console() if "Content Security Policy" in e["message"]
                or "Content-Security-Policy" in e["message"]]

    def requests(self) -> list[dict]:
        """Every request the page sent so far (``{"url", "method", "headers", "type"}``)."""
        self._drain()
        return list(self._requests)

    def foreign_requests(self, origin: str) -> list[str]:
        """URLs requested that are neither under ``origin`` (``http://127.0.0.1:PORT``) nor inline
        (``data:``, ``blob:``, ``about:``)."""
        return [r["url"] for r in self.requests()
                if not (r["url"] == origin or r["url"].startswith(origin + "/")
                        or r["url"].split(":", 1)[0] in ("data", "blob", "about"))]

    # --- driving it ----------------------------------------------------------------------------

    def get(self, url: str) -> None:
        self.driver.get(url)

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def text(self, css: str) -> str:
        """The visible text of the first element matching ``css`` ('' when there is none)."""
        return self.js("const e = document.querySelector(arguments[0]); return e ? e.textContent.trim() : '';", css)

    def shot(self, label: str, full: bool = False) -> Path:
        """Save a screenshot ``NN-label.png`` in the test's folder (``full``: the whole page, not
        only the window); returns its path."""
        self._shots += 1
        path = self.out / f"{self._shots:02d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)}.png"
        if full:
            size = self.driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
            png = self.driver.execute_cdp_cmd("Page.captureScreenshot", {
                "format": "png", "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}})
            path.write_bytes(base64.b64decode(png["data"]))
        else:
            self.driver.save_screenshot(str(path))
        return path

    def close(self, final_label: str = "end") -> None:
        """Keep a last screenshot and the console, then quit the browser."""
        try:
            self.shot(final_label)
            self._drain()
            (self.out / "console.json").write_text(json.dumps(self._console, indent=1))
            (self.out / "requests.json").write_text(json.dumps([r["url"] for r in self._requests], indent=1))
        finally:
            self.driver.quit()
