"""Headless Chromium (Debian's chromium + chromium-driver) through selenium."""

from __future__ import annotations

import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
]


# Software WebGL, for pages that draw with it (speedscope).
WEBGL_FLAGS = ["--use-angle=swiftshader", "--enable-unsafe-swiftshader"]


def start_chromium(webgl: bool = False) -> webdriver.Chrome:
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in FLAGS if not webgl else [f for f in FLAGS if f != "--disable-gpu"] + WEBGL_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-')}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    # On a loaded machine a lookup right after a page's load can miss an element that is
    # in the page (seen once in 60 loads beside stress-ng); the driver retries until found.
    driver.implicitly_wait(20)
    return driver


def console_errors(driver: webdriver.Chrome) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def screenshot(driver: webdriver.Chrome, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def wait_for_flame_graph(driver: webdriver.Chrome) -> None:
    """In a flame graph's frame: until its own init() has run (on load), which finds its frames."""
    WebDriverWait(driver, 20).until(lambda d: d.execute_script("return typeof frames !== 'undefined' && !!frames;"))


def flame_labels(driver: webdriver.Chrome) -> list[tuple[str, str]]:
    """In a flame graph's frame: each frame's shown text and its tooltip (name, count)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#frames g')).filter(g => g.querySelector('text')).map(g => "
        "[g.querySelector('text').textContent, g.querySelector('title').textContent]);"
    )


def first_graph_labels(driver: webdriver.Chrome) -> list[tuple[str, str]]:
    """`flame_labels` of the page's first flame graph, once its script has laid them out."""
    driver.switch_to.frame(driver.find_element("css selector", "iframe.flame"))
    try:
        wait_for_flame_graph(driver)
        return flame_labels(driver)
    finally:
        driver.switch_to.default_content()


def cut_from_the_left(labels: list[tuple[str, str]]) -> list[str]:
    """Labels that lost their start, the function ('..alg.py:57'); a bare '..' had room for no letter."""
    return [text for text, _ in labels if text.startswith("..") and text != ".."]


def search_first_flame_graph(driver: webdriver.Chrome, term: str) -> str:
    """Runs the flame graph's own search in its iframe; returns its 'Matched: N%' text."""
    frame = driver.find_element("css selector", "iframe.flame")
    driver.switch_to.frame(frame)
    try:
        assert driver.find_elements("css selector", "svg"), "the flame graph SVG is present"
        wait_for_flame_graph(driver)
        driver.execute_script("search(arguments[0]);", term)
        return driver.execute_script("return document.getElementById('matched').textContent;")
    finally:
        driver.switch_to.default_content()
