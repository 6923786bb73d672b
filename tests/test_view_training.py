"""``view``'s training pages without a browser: a rows file that grows while it is served, ``--tokenizer``'s and
``--export``'s mistakes (one line, exit 2). In Chromium: ``tests/test_view_training_browser.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, cli
from tests.test_view import serve

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
