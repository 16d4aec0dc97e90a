"""`hydra bench --concurrency 1,4,16 --plot out.html|out.png`: a sweep over concurrency, through
hydra's router and straight to the head's llama-server, drawn as two charts (tokens/s and time
to first token against concurrency, router against direct).

The chart is the dashboard's own: the vendored uPlot (hydra_supervisor/dashboard/static/vendor),
inlined into one self-contained .html that opens offline. A .png is that page rendered by a
headless Chromium (the system's `chromium`, as the dashboard's tests use), so hydra needs no
plotting library; without Chromium, write .html (the error says so).

"Direct" is the profile's head at its internal address, read from the running hydra's status
(cli/running.py: the control socket); a profile that hydra does not serve here has no direct
leg.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from hydra_supervisor.config import infile
from hydra_supervisor.errors import HydraError

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def parse_levels(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (each 1..256, no repeats, in the order given)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            n = int(part)
        except ValueError:
            raise HydraError(f"--concurrency {text!r}: {part!r} is not a whole number") from None
        if not 1 <= n <= 256:
            raise HydraError(f"--concurrency {text!r}: {n} is not in 1..256")
        if n not in out:
            out.append(n)
    if not out:
        raise HydraError("--concurrency needs at least one number")
    return out


def point(report: Any, leg: str) -> dict[str, Any]:
    """One point of the sweep, from a bench Report."""
    return {"leg": leg, "concurrency": report.concurrency, "url": report.url,
            "ok": report.ok, "requests": report.requests,
            "throughput_tps": round(report.throughput_tps, 3),
            "ttft_p50_ms": report.ttft_ms["p50"], "ttft_p95_ms": report.ttft_ms["p95"],
            "decode_p50_tps": report.decode_tps["p50"]}


def _static(name: str) -> str:
    """A file of the dashboard's static dir, to inline (`</script>` cannot occur in it)."""
    text = (resources.files("hydra_supervisor.dashboard") / "static" / name).read_text()
    return text.replace("</script", "<\\/script")


def render_html(points: Sequence[dict[str, Any]], title: str) -> str:
    """One self-contained page: uPlot and the data inlined; no network."""
    data = json.dumps(list(points)).replace("</", "<\\/")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>
<style>{_static("vendor/uPlot.min.css")}
body {{ font: 14px system-ui, "DejaVu Sans", sans-serif; margin: 18px 24px; color: #1d2330; }}
h1 {{ font-size: 17px; margin: 0 0 4px; }} .note {{ color: #6b7280; font-size: 12px; }}
.charts {{ display: flex; gap: 28px; flex-wrap: wrap; margin-top: 12px; }}
h2 {{ font-size: 14px; margin: 0 0 4px; }}
table {{ border-collapse: collapse; margin-top: 14px; font-size: 12px; }}
td, th {{ padding: 3px 10px 3px 0; text-align: right; border-bottom: 1px solid #e3e6ea; }}
th:first-child, td:first-child {{ text-align: left; }}
</style></head><body>
<h1>{_esc(title)}</h1>
<div class="note">hydra bench: tokens/s = all requests' decoded tokens / wall time; TTFT = median
time to the first token on the client's clock. router = through hydra's port; direct = the
head's llama-server, bypassing the router.</div>
<div class="charts"><div><h2>Throughput (tokens/s)</h2><div id="tps"></div></div>
<div><h2>Time to first token, p50 (ms)</h2><div id="ttft"></div></div></div>
<table id="table"></table>
<script>{_static("vendor/uPlot.iife.min.js")}</script>
<script>const P = {data};</script>
<script>{_static("benchplot.js")}</script>
</body></html>
"""


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def check_target(path: Path) -> None:
    """Before a sweep runs (minutes): --plot names a .html or .png in a directory that exists,
    and a .png has a Chromium to render it."""
    suffix = path.suffix.lower()
    if suffix not in (".html", ".htm", ".png"):
        raise HydraError(f"--plot {path}: write .html or .png")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise HydraError(f"--plot {path}: directory {parent} does not exist",
                         hint=f"mkdir -p {parent}, or write the chart elsewhere")
    if not os.access(parent, os.W_OK):
        raise HydraError(f"--plot {path}: directory {parent} is not writable")
    try:
        kind = infile.kind_of(os.stat(path))
    except OSError:
        kind = None  # not there yet: written new
    if kind is not None:  # a FIFO would block the write, a device take the page
        raise HydraError(f"--plot {path} is {kind}, not a file",
                         hint="name a new .html or .png file")
    if suffix == ".png" and chromium() is None:
        raise HydraError("--plot .png renders the chart with a headless Chromium, and none is "
                         "installed", hint="write .html instead (it opens offline), or install "
                         "chromium (Debian: apt-get install chromium)")


def write(path: Path, points: Sequence[dict[str, Any]], title: str) -> None:
    """.html: the page; .png: the page rendered by headless Chromium."""
    check_target(path)
    html = render_html(points, title)
    if path.suffix.lower() in (".html", ".htm"):
        try:
            path.write_text(html)
        except OSError as exc:
            raise HydraError(f"--plot {path}: cannot write it: {exc.strerror or exc}") from None
        return
    exe = chromium()
    assert exe is not None  # check_target
    with tempfile.TemporaryDirectory(prefix="hydra-plot-") as tmp:
        page = Path(tmp) / "plot.html"
        page.write_text(html)
        shot = Path(tmp) / "plot.png"
        rows = len(points)
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu",
               "--disable-background-networking", "--disable-component-update",
               "--no-first-run", "--disable-sync", "--hide-scrollbars",
               f"--user-data-dir={Path(tmp) / 'profile'}",
               f"--window-size=1040,{470 + 24 * rows}", "--virtual-time-budget=3000",
               f"--screenshot={shot}", page.as_uri()]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False,
                                 env={**os.environ, "HOME": tmp})
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise HydraError(f"--plot: {exe} failed: {exc}") from None
        if not shot.exists():
            raise HydraError(f"--plot: {exe} wrote no picture (exit {res.returncode}): "
                             f"{res.stderr.strip()[-300:]}", hint="write .html instead")
        try:
            shutil.copyfile(shot, path)
        except OSError as exc:
            raise HydraError(f"--plot {path}: cannot write it: {exc.strerror or exc}") from None
