"""Regenerates docs/images/report.png, the README's picture of the report: runs the demo,
then screenshots the top of its HTML report (the summary and the workers' timeline) in
headless Chromium, started as the browser tests start it. Run from anywhere as
`python docs/screenshot.py`; it refuses to keep a report that warns of oversubscription
(a busy machine waits for CPUs), so the picture stays true."""

from __future__ import annotations

import base64
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "docs" / "images" / "report.png"
DAYS = 10  # half the demo's default: the same parts in the same shares, in half the time
WIDTH = 1400  # the browser tests' window, as wide as the report's tables need
MARGIN = 16  # px above the next section's heading


def run_demo(report: Path) -> None:
    subprocess.run([sys.executable, "-m", "dask_pyspy", "demo", "--days", str(DAYS), "-o", str(report)], check=True)


def screenshot(report: Path) -> None:
    sys.path.insert(0, str(ROOT))  # the browser tests' Chromium set-up, not a copy of it
    from tests.cluster.browser import start_chromium

    driver = start_chromium()
    try:
        driver.get(report.as_uri())
        # Other warnings (a CPU budget that held the rate down) are this machine's, and stay.
        busy = [w.text for w in driver.find_elements("css selector", ".warn") if w.text.startswith("Oversubscribed")]
        if busy:
            sys.exit(
                "the report warns of oversubscription, so it would not show the demo as it is; run again on a "
                "quieter machine:\n" + "\n".join(busy)
            )
        # The summary in words and the workers' timeline, down to the next process kind's
        # (the scheduler's) or the next section: a picture a README can show at full size.
        end = driver.find_element(
            "xpath", "(//h2[normalize-space()='Timeline']/following::*[self::h2 or @class='tl-kind'])[2]"
        ).location["y"]
        clip = {"x": 0, "y": 0, "width": WIDTH, "height": end - MARGIN, "scale": 1}
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"clip": clip, "captureBeyondViewport": True})
    finally:
        driver.quit()
    IMAGE.parent.mkdir(parents=True, exist_ok=True)
    IMAGE.write_bytes(base64.b64decode(shot["data"]))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "dask-pyspy-demo.html"
        run_demo(report)
        screenshot(report)
    print(f"Wrote {IMAGE.relative_to(ROOT)}: {IMAGE.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
