"""The run report as a reader sees it: a real short demo run (`launcher run` of configs/demo.yaml — real
redis-server, embedded server, learner and rollout processes) writes report.html and report/*.png at
exit; the HTML is then opened from disk (file://, no server) in headless Chromium (Debian's
/usr/bin/chromium, driven over the DevTools protocol by tests/integration/_chromium.py) and every
<img> must have been decoded by the browser, with a source inside the run dir (an inline PNG equal
to its file in report/, or a relative path to an existing file).

A second test breaks a copy of the report (one image pointed at a deleted PNG, one with a data URI
that is not a PNG) and checks that the same check names exactly those images as not loaded.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import struct
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from _chromium import CHROMIUM, SETUP_HINT, Image, Page, broken_images, open_page
from conftest import launcher_cli

pytestmark = pytest.mark.integration

STEPS = 6
# Figures a finished demo run with validation has data for (file stem → section title); the report
# may hold more (buffer depth, busy fraction when the rows carry them), never fewer.
EXPECTED_FIGURES = {"reward": "Reward", "validation": "Validation", "samples_per_s": "Samples per second",
                    "staleness": "Staleness", "seconds": "Push, fetch and step seconds", "drops": "Drops",
                    "training": "Learner statistics"}
# Every figure section the report has, with an image or a note saying what is missing.
ALL_SECTIONS = set(EXPECTED_FIGURES.values()) | {"Generation busy fraction", "Buffer depth"}


def _require_chromium() -> None:
    if not os.path.exists(CHROMIUM):
        # set-up installs it: a skip would hide a broken set-up
        pytest.fail(f"{CHROMIUM} is missing: {SETUP_HINT}", pytrace=False)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, demo_assets) -> Path:
    """The run dir of a finished 6-step demo run (validation at steps 3 and 6), report written at exit."""
    _require_chromium()  # before spending a run on it
    model, data = demo_assets
    run_dir = tmp_path_factory.mktemp("report-browser") / "demo-run"
    rc, out = launcher_cli("run", "--config", "configs/demo.yaml", "--run-dir", str(run_dir), f"model.path={model}",
                           f"data.train_files=[{data}]", f"train.total_steps={STEPS}", "train.batch_size=2",
                           "generation.n=4", "train.test_freq=3", "metrics.report=true", timeout=240)
    assert rc == 0, out[-4000:]
    assert f"[launcher] report: {run_dir / 'report.html'}" in out, out[-4000:]
    return run_dir


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR", png[:16]
    return struct.unpack(">II", png[16:24])


def _inside(run_dir: Path, path: Path) -> bool:
    return os.path.commonpath([run_dir.resolve(), path.resolve()]) == str(run_dir.resolve())


def _source_problem(run_dir: Path, img: Image) -> str | None:
    """Why `img`'s source is not readable from the run dir alone, or None."""
    if img.src.startswith("data:"):
        m = re.fullmatch(r"data:image/png;base64,([A-Za-z0-9+/=]+)", img.src)
        if not m:
            return "src is a data URI but not a base64 PNG"
        if not img.file:
            return "inline PNG without data-file (the PNG beside the report it copies)"
        path = run_dir / img.file
        if not _inside(run_dir, path) or not path.is_file():
            return f"data-file {img.file} is not a file in the run dir"
        if path.read_bytes() != base64.b64decode(m[1]):
            return f"inline PNG differs from {img.file}"
        return None
    parts = urlsplit(img.src)
    if parts.scheme or parts.netloc or parts.path.startswith("/") or not parts.path:
        return "src is neither a data URI nor a path relative to report.html (needs a server or another dir)"
    path = run_dir / unquote(parts.path)
    if not _inside(run_dir, path) or not path.is_file():
        return f"{parts.path} is not a file in the run dir"
    return None


def check_report(run_dir: Path) -> Page:
    """Open run_dir/report.html in Chromium; AssertionError listing every image that did not load or
    whose source is not in the run dir. Returns the page for further checks."""
    _require_chromium()
    html = run_dir / "report.html"
    assert html.is_file(), f"no {html}"
    page = open_page(str(html))
    problems = [f"{i.short()}: not loaded by chromium" for i in broken_images(page)]
    problems += [f"{i.short()}: {why}" for i in page.images if (why := _source_problem(run_dir, i))]
    # Readable without a server: the page asked for nothing but itself, data URIs and files in the run dir.
    for url in page.requests:
        parts = urlsplit(url)
        if parts.scheme == "data":
            continue
        if parts.scheme != "file" or not _inside(run_dir, Path(unquote(parts.path))):
            problems.append(f"the page requested {url[:120]}: outside the run dir")
    assert not problems, f"{html} in {CHROMIUM}:\n" + "\n".join(problems)
    return page


def test_report_opens_in_chromium_with_every_image(demo_run):
    run_dir = demo_run
    pngs = {p.stem: p for p in (run_dir / "report").glob("*.png")}
    assert set(EXPECTED_FIGURES) <= set(pngs), sorted(pngs)

    page = check_report(run_dir)  # every image loaded, every source in the run dir

    assert page.title == "demo-run — areal_like run report", page.title
    h1 = [h["text"] for h in page.headings if h["tag"] == "h1"]
    assert h1 == ["Run report: demo-run"], page.headings
    h2 = {h["text"] for h in page.headings if h["tag"] == "h2"}
    assert ALL_SECTIONS <= h2, sorted(h2)  # each figure: image or note, never silently missing

    # One image per PNG on disk, each the same picture at the size the browser decoded.
    assert len(page.images) == len(pngs) >= len(EXPECTED_FIGURES), [i.short() for i in page.images]
    by_file = {i.file: i for i in page.images}
    assert set(by_file) == {f"report/{stem}.png" for stem in pngs}, sorted(by_file)
    for stem, path in pngs.items():
        img = by_file[f"report/{stem}.png"]
        assert (img.natural_width, img.natural_height) == _png_size(path.read_bytes()), img.short()
    for stem, title in EXPECTED_FIGURES.items():
        assert by_file[f"report/{stem}.png"].alt == title
    assert page.requests and page.requests[0] == page.url  # the file itself, then inline images only


def test_check_reports_broken_images(demo_run, tmp_path):
    """The checker itself: in a copy of the run dir, the reward image points at its PNG file, which is
    deleted; the validation image's data URI holds no PNG; the staleness image points at its PNG file,
    which is kept. The check must name reward and validation as not loaded, and only them."""
    _require_chromium()
    run_dir = tmp_path / "demo-run"
    shutil.copytree(demo_run, run_dir, ignore=shutil.ignore_patterns("*.sock", "redis*"))
    html_path = run_dir / "report.html"
    html = html_path.read_text(encoding="utf-8")
    not_png = "data:image/png;base64," + base64.b64encode(b"this is not a PNG").decode()
    for stem, src in (("reward", "report/reward.png"), ("validation", not_png),
                      ("staleness", "report/staleness.png")):
        html, n = re.subn(rf'<img src="[^"]*"( alt="[^"]*" data-file="report/{stem}\.png")',
                          lambda m, src=src: f'<img src="{src}"{m[1]}', html)
        assert n == 1, stem
    html_path.write_text(html, encoding="utf-8")
    (run_dir / "report" / "reward.png").unlink()

    with pytest.raises(AssertionError) as err:
        check_report(run_dir)
    msg = str(err.value)
    problem_lines = msg.splitlines()[1:]
    assert any("data-file='report/reward.png'" in ln and "not loaded by chromium" in ln for ln in problem_lines), msg
    assert any("data-file='report/reward.png'" in ln and "not a file in the run dir" in ln
               for ln in problem_lines), msg
    assert any("data-file='report/validation.png'" in ln and "not loaded by chromium" in ln
               for ln in problem_lines), msg
    assert not any("staleness" in ln for ln in problem_lines), msg  # a relative file that exists is fine
    named = {m for ln in problem_lines for m in re.findall(r"data-file='report/(\w+)\.png'", ln)}
    assert named == {"reward", "validation"}, msg

    page = open_page(str(html_path))
    assert {Path(i.file).stem for i in broken_images(page)} == {"reward", "validation"}
    assert len(page.images) == len(list((demo_run / "report").glob("*.png")))
