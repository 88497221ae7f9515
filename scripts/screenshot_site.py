"""Build the documentation site and take a screenshot of its start page with headless Chromium.

    python scripts/screenshot_site.py               # writes docs/images/site-start.png
    python scripts/screenshot_site.py --page guides/sharing.html --out /tmp/sharing.png

Needs the docs extra (``pip install -e '.[docs]'``), selenium, and the system's Chromium and
chromedriver (Debian: ``apt-get install chromium chromium-driver``). The site is served on
loopback for the browser, as ``mkdocs serve`` would serve it.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "images" / "site-start.png"


def build(site: Path) -> None:
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    subprocess.run(command, cwd=REPO, env=env, check=True)


def screenshot(site: Path, page: str, out: Path, width: int, height: int) -> None:
    from selenium import webdriver

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        raise SystemExit("no chromium/chromedriver (apt-get install chromium chromium-driver)")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument(f"--window-size={width},{height}")
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(chromedriver))
    try:
        driver.set_page_load_timeout(30)
        driver.get(f"http://127.0.0.1:{httpd.server_address[1]}/{page}")
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
    finally:
        driver.quit()
        httpd.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", default="index.html", help="the page, relative to the site")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the PNG to write")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=900)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        build(site)
        screenshot(site, args.page, args.out, args.width, args.height)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
