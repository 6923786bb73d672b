"""Issue 75, "What a new user meets now" (points 3-9): each mistake tried as the user makes it, through the CLI in a
subprocess where the user meets it there: one line naming what to do, exit 2, no traceback, never "a bug in
gym-runtime". The Ray points (1, 2) are in ``tests/on_ray/test_ray_addresses.py``; the trainer points (9, 10) in
``tests/test_trainer_arguments.py`` and ``tests/trainers/test_trl_slips.py``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, WEATHER, cli

EXAMPLE = REPO / "resources/weather/data/example.jsonl"
RUN = REPO / "tests" / "data" / "train_run"


def train_rows(tmp_path: Path) -> str:
    """The training run's rows, copied (``view`` keeps its index beside the file it reads)."""
    (tmp_path / "train_rows.jsonl").write_bytes((RUN / "train_rows.jsonl").read_bytes())
    return str(tmp_path / "train_rows.jsonl")


def one_line(res: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """The user's mistake said in one line (JSON log lines aside), exit 2, no traceback; that line."""
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, res.stderr
    said = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith("{")]
    assert len(said) == 1, res.stderr
    for f in fragments:
        assert f in said[0], (f, said[0])
    return said[0]


# ------------------------------------------------------------------ 4. the user's own module is the user's bug

BROKEN = {
    "syntax": ("def broken(:\n", "SyntaxError: invalid syntax"),
    "indentation": ("if True:\nx = 1\n", "IndentationError: expected an indented block"),
    "import": ("import nosuch_package_of_theirs\n", "install 'nosuch_package_of_theirs', or fix that import"),
    "raises": ("LIMIT = 1 / 0\n", "ZeroDivisionError: division by zero"),
}


def broken_config(tmp_path: Path, role: str, code: str) -> Path:
    """A config beside the user's own module (found relative to the config) whose line 3 is ``code``."""
    if role == "resource":
        module = "from gym_runtime.resources.weather import Weather\n\nresource = Weather\n"
        text = WEATHER.read_text().replace("server: resources.weather", "server: my_env")
        name = "my_env"
    else:
        module = "from gym_runtime.agents.simple import run\n\n__all__ = ['run']\n"
        text = WEATHER.read_text().replace("agent: agents.simple", "agent: my_agent")
        name = "my_agent"
    lines = module.splitlines(keepends=True)
    (tmp_path / f"{name}.py").write_text("".join(lines[:2]) + code + "".join(lines[2:]))
    (tmp_path / "config.yaml").write_text(text)
    return tmp_path / "config.yaml"


@pytest.mark.parametrize("role", ["resource", "agent"])
@pytest.mark.parametrize("kind", list(BROKEN))
def test_an_error_in_the_users_own_module_is_one_line_naming_its_file_line_and_entry(
    role: str, kind: str, tmp_path: Path
) -> None:
    code, words = BROKEN[kind]
    config = broken_config(tmp_path, role, code)
    res = cli("run", str(config), "-i", str(EXAMPLE), "-o", str(tmp_path / "o.jsonl"), timeout=120)
    name = "my_env" if role == "resource" else "my_agent"
    entry = "resources.weather.server" if role == "resource" else "agents.weather_agent.agent"
    line = one_line(res, entry, words)
    assert f"{tmp_path / name}.py:" in line and ("fix the code there" in line or "fix that import" in line), line
    assert "pip install 'gym-runtime[envs]'" not in line  # the user's module is not one of the bundled ones
    assert not (tmp_path / "o.jsonl").exists()


# ------------------------------------------------------------------ 8. a negative checkpoint TTL is refused


def test_a_negative_checkpoint_ttl_is_refused_at_config_time(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    res = cli("run", "weather", "-o", str(out), "--set", "jetstream.checkpoint_ttl_s=-1")
    one_line(res, "jetstream.checkpoint_ttl_s: -1.0 must be >= 0 seconds", "0 keeps checkpoints until deleted")
    assert not out.exists()
    zero = cli("run", "weather", "-o", str(out), "--set", "jetstream.checkpoint_ttl_s=0", "--quiet")
    assert zero.returncode == 0, zero.stderr  # 0: kept until deleted, as the bucket's TTL of 0 says
    assert len([json.loads(x) for x in out.read_text().splitlines()]) == 5


# ------------------------------------------------------------------ 3. a training run's headline, per group


def test_a_training_runs_headline_pass_at_k_is_over_its_groups_not_rows_sharing_a_task_index(tmp_path: Path) -> None:
    """The run's 48 rows: 6 steps of two groups of 4, each step's tasks numbered 0 and 1 by its trainer call. Pooled
    by task index, pass@24 was 100% (a pass somewhere in 24 rows of different prompts and steps); over its 12
    groups, pass@4 is the share of groups with a pass among their 4."""
    res = cli("view", train_rows(tmp_path), "--export", str(tmp_path / "b"))
    assert res.returncode == 0, res.stderr
    page = (tmp_path / "b" / "index.html").read_text()
    assert 'pass@1 10.4%, pass@4 41.7% <span class="note">over groups</span>' in page, page
    assert "pass@24" not in page
    assert "each one dataset row at one step" in page


# ------------------------------------------------------------------ 5, 6. a bundle: where it goes, what it holds


def test_an_export_into_a_folder_of_the_users_files_is_refused_and_a_bundle_replaces_its_own(tmp_path: Path) -> None:
    rows = train_rows(tmp_path)
    mine = tmp_path / "site"
    mine.mkdir()
    (mine / "index.html").write_text("my page\n")
    refused = cli("view", rows, "--export", str(mine))
    one_line(refused, f"--export {mine}: a folder holding other files (index.html)", "--force")
    assert (mine / "index.html").read_text() == "my page\n" and sorted(p.name for p in mine.iterdir()) == ["index.html"]
    forced = cli("view", rows, "--export", str(mine), "--force")
    assert forced.returncode == 0, forced.stderr
    assert "Runs" in (mine / "index.html").read_text()
    # a bundle written again (another filter) replaces its own files: none of the first one's pages is left behind
    bundle = tmp_path / "bundle"
    first = cli("view", rows, "--export", str(bundle), "--filter", "failure=any")
    assert first.returncode == 0, first.stderr
    assert (bundle / "rollout-0-0-18.html").is_file()
    again = cli("view", rows, "--export", str(bundle), "--filter", "failure=none&run=0")
    assert again.returncode == 0, again.stderr
    assert not (bundle / "rollout-0-0-18.html").exists() and (bundle / "rollout-0-0-0.html").is_file()
    (bundle / "notes.txt").write_text("the user's\n")  # a bundle folder the user added to is written again
    assert cli("view", rows, "--export", str(bundle)).returncode == 0
    assert (bundle / "notes.txt").read_text() == "the user's\n"


@pytest.mark.parametrize(
    ("given", "fix"),
    [
        ("failure=anyy", "no failure 'anyy' in these rows; did you mean 'any'? give one of any, none, verify_error"),
        ("run=5", "no run 5; the runs given are 0"),
        ("agent=nosuch", "no agent 'nosuch' in these rows"),
        ("failur=any", "no filter 'failur'; did you mean 'failure'?"),
        ("sort=rewrd", "no sort 'rewrd'; give one of order, reward"),
    ],
)
def test_a_bundle_filter_that_matches_nothing_that_exists_is_one_line(given: str, fix: str, tmp_path: Path) -> None:
    res = cli("view", train_rows(tmp_path), "--export", str(tmp_path / "b"), "--filter", given)
    one_line(res, f"--filter {given!r}: {fix}")
    assert not (tmp_path / "b").exists()  # no empty bundle


def test_a_filtered_bundles_table_is_linked_from_its_pages(tmp_path: Path) -> None:
    out = tmp_path / "b"
    res = cli("view", train_rows(tmp_path), "--export", str(out), "--filter", "failure=any")
    assert res.returncode == 0, res.stderr
    for page in ("index.html", "rollout-0-0-18.html", "group-0-4.html", "steps-0.html"):
        assert '<a href="rollouts.html" id="nav-rollouts">' in (out / page).read_text(), page
    assert "rollout-0-0-18.html" in (out / "rollouts.html").read_text()


# ------------------------------------------------------------------ 7. a tokenizer of another model


def other_model_tokenizer(tmp_path: Path) -> Path:
    """The run's tokenizer with its words' ids rotated by three: a tokenizer of another vocabulary, as loadable."""
    doc = json.loads((RUN / "tokenizer" / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    words = sorted((w for w in vocab if vocab[w] >= 9), key=vocab.__getitem__)  # the words (0-8: specials, roles)
    ids = [vocab[w] for w in words]
    vocab.update(zip(words, ids[3:] + ids[:3], strict=True))
    out = tmp_path / "other" / "tokenizer.json"
    out.parent.mkdir()
    out.write_text(json.dumps(doc))
    return out


def test_a_tokenizer_of_another_model_is_one_line_and_the_runs_own_is_taken(tmp_path: Path) -> None:
    rows = train_rows(tmp_path)
    other = other_model_tokenizer(tmp_path)
    res = cli("view", rows, "--tokenizer", str(other), "--export", str(tmp_path / "b"))
    one_line(
        res,
        f"--tokenizer {other}: decodes these rows' tokens into other words",
        "the row says 'stone ', this tokenizer reads 'ok ",
        "give the tokenizer of the model that wrote them",
    )
    assert not (tmp_path / "b").exists()
    served = cli("view", rows, "--tokenizer", str(other), "--port", "0")  # served: refused before it listens
    one_line(served, "decodes these rows' tokens into other words")
    good = cli("view", rows, "--tokenizer", str(RUN / "tokenizer"), "--export", str(tmp_path / "b"))
    assert good.returncode == 0, good.stderr
    assert "stone" in (tmp_path / "b" / "tokens-0-0-1.html").read_text()
