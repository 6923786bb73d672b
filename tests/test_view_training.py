"""``view``'s training pages without a browser: a rows file that grows while it is served, ``--tokenizer``'s and
``--export``'s mistakes (one line, exit 2). In Chromium: ``tests/test_view_training_browser.py``."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers import REPO, cli
from tests.test_view import Served, serve

RUN = Path(__file__).resolve().parent / "data" / "train_run"


def test_a_training_rows_file_that_grows_is_read_as_it_grows(tmp_path: Path) -> None:
    lines = (RUN / "train_rows.jsonl").read_bytes().splitlines(keepends=True)
    path = tmp_path / "train_rows.jsonl"
    path.write_bytes(b"".join(lines[:8]))  # the first step's rows (8 a step)

    def page(url: str) -> str:
        status, _, body = site.get(url)
        assert status == 200, (url, body[:300])
        return body.decode()

    for site in serve(str(path)):
        assert "8 rollouts" in page("/rollouts")
        steps = page("/steps/0")
        assert "step 0:" in steps and "step 1:" not in steps
        assert site.get("/group/0/2")[0] == 404  # two groups of 4 so far
        with path.open("ab") as f:  # the trainer's next step, and half of a line still being written
            f.write(b"".join(lines[8:16]) + lines[16][:40])
        assert "16 rollouts" in page("/rollouts")  # the torn line waits
        assert site.get("/group/0/3")[0] == 200
        assert "step 1:" in page("/steps/0")
        with path.open("ab") as f:
            f.write(lines[16][40:])
        assert "17 rollouts" in page("/rollouts")
        assert "17" in page("/")  # the runs page's counts follow


def test_tokenizer_and_export_mistakes_are_one_line(tmp_path: Path) -> None:
    rows = str(RUN / "train_rows.jsonl")
    missing = cli("view", rows, "--tokenizer", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"gym-runtime: error: --tokenizer {tmp_path / 'nowhere'}: no tokenizer.json there (give a model folder or "
        "its tokenizer.json)"
    ], missing.stderr
    # the optional extra not installed: an import of ``tokenizers`` fails as it does without the package
    no_extra = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['tokenizers'] = None; from gym_runtime.cli import main; "
            f"sys.argv = ['gym-runtime', 'view', {rows!r}, '--tokenizer', {str(RUN / 'tokenizer')!r}]; "
            "sys.exit(main())",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert no_extra.returncode == 2 and "Traceback" not in no_extra.stderr, no_extra.stderr
    assert no_extra.stderr.strip().splitlines() == [
        "gym-runtime: error: --tokenizer needs the 'tokenizers' package: pip install 'gym-runtime[tokenizers]' "
        "(or leave --tokenizer out: token ids are shown)"
    ]
    alone = cli("view", rows, "--filter", "run=0")
    assert alone.returncode == 2 and "--filter goes with --export" in alone.stderr
    bad = cli("view", rows, "--export", str(tmp_path / "b"), "--filter", "rmin=high")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--filter 'rmin=high'" in bad.stderr, bad.stderr
    (tmp_path / "file").write_text("")
    onto = cli("view", rows, "--export", str(tmp_path / "file"))
    assert onto.returncode == 2 and "not a folder" in onto.stderr


BIG = 1234567890123456789012345678901234567890  # 40 digits: beyond int64, within a float's range
HUGE = 10**400  # beyond a float's range


def any_number_rows(path: Path) -> Path:
    """The first two steps of the training run, their training fields holding every number a JSON writer can
    write: ±1e308, 10**400, 40-digit integers, NaN and the infinities (Python's json writes them as written)."""
    rows = [json.loads(line) for line in (RUN / "train_rows.jsonl").read_bytes().splitlines()[:16]]
    odd: list[dict[str, Any]] = [
        {"train_reward": 1e308, "train_advantage": -1e308},
        {"train_reward": -1e308, "train_advantage": 1e308},
        {"train_reward": HUGE, "train_advantage": -HUGE},
        {"train_reward": BIG, "train_advantage": BIG},
        {"train_reward": math.nan, "train_advantage": math.inf},
        {"train_reward": math.inf, "train_advantage": -math.inf},
        {"train_reward": -math.inf, "train_advantage": math.nan},
        {"train_group": BIG},
        {"reward": 1e308, "train_reward": 1e308},
        {"reward": -1e308, "train_reward": -1e308},
        {"reward": HUGE, "train_step": BIG},
        {"cost": {"models": {"policy": {"output_tokens": BIG}}}, "train_reward": math.nan},
        {"cost": {"models": {"policy": {"output_tokens": 2**63 - 1}}}},
        {"cost": {"models": {"policy": {"output_tokens": 2**63 - 1}}}},
        {"reward": math.inf, "train_step": 10**15},
        {"reward": math.nan, "train_advantage": 1e-320},
    ]
    for r, changes in zip(rows, odd, strict=True):
        r.update(changes)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_training_fields_holding_any_number_are_served_and_exported_without_the_exporters_paths(
    tmp_path: Path,
) -> None:
    """Issue 73: the step and group pages answered 500 (``OverflowError`` in their statistics) on ±1e308, 10**400
    or 40-digit values, and ``--export`` wrote the rows file's absolute path into ``index.html``. Every page now
    answers 200 with each value shown as written (or "not a number"), and the bundle names the file by its base
    name, with no token and no variable of the exporter's environment."""
    path = any_number_rows(tmp_path / "rows" / "train_rows.jsonl")
    for site in serve(str(path)):

        def page(url: str, site: Served = site) -> str:
            status, _, body = site.get(url)
            assert status == 200, (url, status, body[:2000])
            return body.decode()

        runs = page("/")
        groups = [f"/group/0/{n}" for n in range(16) if site.get(f"/group/0/{n}")[0] != 404]
        assert len(groups) >= 4, groups
        shown = "".join(page(g) for g in groups)
        for value in ("1e+308", "-1e+308", "1e+400", "-1e+400", "1.23456e+39", "not a number", "inf", "-inf"):
            assert value in shown, value
        assert "1e-320" in shown or "9.99989e-321" in shown
        steps = page("/steps/0")
        assert "1.23456e+39" in steps or str(BIG) in steps  # the 40-digit step, as written
        for n in range(16):
            page(f"/rollout/0/0/{n}")
            page(f"/tokens/0/0/{n}")
        assert "16 rollouts" in page("/rollouts") and "16" in runs
        token = site.token
    secret = "sk-exporters-environment-0123456789"
    out = tmp_path / "bundle"
    exported = subprocess.run(
        [sys.executable, "-m", "gym_runtime.cli", "view", str(path), "--export", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "GYM_EXPORT_TEST_SECRET": secret},
        timeout=300,
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert (out / "index.html").is_file() and len(files) > 30
    index = (out / "index.html").read_text()
    assert "train_rows.jsonl" in index  # the file, by its base name
    leaks = {
        "the rows file's folder": str(path.parent).encode(),
        "the exporter's working folder": str(tmp_path).encode(),
        "the exporter's home": str(Path.home()).encode() + b"/",
        "the live view's token": token.encode(),
        "a variable of the exporter's environment": secret.encode(),
    }
    found = [(what, p.name) for p in files for what, needle in leaks.items() if needle in p.read_bytes()]
    assert found == []
    bundled = "".join(p.read_text() for p in files if p.name.startswith("group-"))
    assert all(value in bundled for value in ("1e+308", "1e+400", "1.23456e+39", "not a number")), bundled[:2000]


def test_the_plots_ticks_are_round_and_the_reward_band_stays_above_the_reward_floor(tmp_path: Path) -> None:
    """Issue 75: the y axis is labelled at round values (a 1, 2, 2.5 or 5 times a power of ten step, not 0.0947), and
    the reward's spread band never goes below 0, the least reward these rows have (a training run's rows)."""
    rows = tmp_path / "train_rows.jsonl"
    rows.write_bytes((REPO / "tests/data/train_run/train_rows.jsonl").read_bytes())
    res = cli("view", str(rows), "--export", str(tmp_path / "bundle"))
    assert res.returncode == 0, res.stderr
    page = (tmp_path / "bundle" / "steps-0.html").read_text()
    for plot in ("plot-reward", "plot-pass", "plot-failures", "plot-length"):
        fig = re.search(rf'<figure class="plot" id="{plot}">(.*?)</figure>', page, re.S)
        assert fig is not None, plot
        labels = [float(x) for x in re.findall(r'text-anchor="end">([^<]*)', fig.group(1))]
        step = labels[1] - labels[0]
        mantissa = step / 10 ** math.floor(math.log10(step))
        assert any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5)), (plot, labels)
        assert all(math.isclose(v / step, round(v / step), abs_tol=1e-9) for v in labels), (plot, labels)
        if plot == "plot-reward":
            grid = [float(y) for y in re.findall(r'<line class="grid"[^>]*y1="([^"]*)"', fig.group(1))]
            zero = grid[labels.index(0.0)]  # (SVG's y grows downward: below 0 is a larger y)
            band = re.findall(r'<polygon class="band" points="([^"]*)"', fig.group(1))
            assert band, fig.group(1)[:500]
            ys = [float(p.split(",")[1]) for p in band[0].split()]
            assert max(ys) <= zero + 0.05, (ys, zero)
