"""The docs site and the README: the site builds with ``mkdocs build --strict`` (no broken link or anchor,
every page in ``nav``), and the README stays a short front page whose links all land on pages of the site."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.docker import docker_socket

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def nav_pages() -> list[str]:
    """The pages mkdocs.yml lists in ``nav`` (one level: a title and its page)."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    return [page for entry in nav for page in entry.values()]


def build(site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor, not a build warning
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml")]
        + ["--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def html_of(site: Path, page: str) -> Path:
    """Where the site puts a page: index.md -> index.html, x.md -> x/index.html."""
    return site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")


def fenced(text: str, heading: str) -> str:
    """The first ```bash block under ``heading``."""
    section = text.split(heading, 1)[1]
    return section.split("```bash", 1)[1].split("```", 1)[0]


def test_site_builds_strict_with_every_page_in_nav(tmp_path: Path) -> None:
    site = tmp_path / "site"
    res = build(site)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "WARNING" not in res.stderr, res.stderr
    pages = nav_pages()
    assert sorted(pages) == sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    for page in pages:
        assert html_of(site, page).is_file(), page


def test_readme_is_short_and_links_only_to_pages_of_the_site(tmp_path: Path) -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    targets = LINK.findall(text)
    assert targets, "the README links into docs/"
    pages = set(nav_pages())
    site = tmp_path / "site"
    for target in targets:
        path, _, anchor = target.partition("#")
        assert path.startswith("docs/") and path.endswith(".md"), target
        page = path.removeprefix("docs/")
        assert (DOCS / page).is_file() and page in pages, target
        if anchor:  # a heading of that page, as the site spells its ids
            if not site.exists():
                assert build(site).returncode == 0
            assert f'id="{anchor}"' in html_of(site, page).read_text(), target
    assert {t.partition("#")[0].removeprefix("docs/") for t in targets} == pages  # every page is reachable


def test_readme_keeps_the_set_up_and_test_commands() -> None:
    """The two commands a newcomer copies, which test_run and .ci/run follow, stay in the README as written."""
    text = README.read_text()
    setup = fenced(text, "## Set up and run")
    assert "python3 -m venv .venv && . .venv/bin/activate && pip install -e ." in setup
    assert (
        "gym-runtime run resources/weather/config.yaml -i resources/weather/data/example.jsonl -o runs/out.jsonl"
        in setup
    )
    tests = fenced(text, "## Run the tests")
    command = "python -m pytest -q -n 4 --dist worksteal"
    assert "pip install -e '.[dev]'" in tests and command in tests
    # the engine the sandbox fleet's tests need, started before them (without it they skip: tests/test_engine_skips.py)
    assert tests.index('eval "$(bash .ci/docker.sh start)"') < tests.index(command)
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci.count(command) == 1  # CI runs exactly that, once, in a fresh clone


def test_deploy_readme_points_at_pages_that_exist() -> None:
    deploy = REPO / "deploy" / "README.md"
    targets = LINK.findall(deploy.read_text())
    assert targets
    for target in targets:
        assert (deploy.parent / target.partition("#")[0]).resolve().is_file(), target


def test_the_index_page_lists_every_page_of_the_site() -> None:
    """The front page's table is how a reader finds a page: each page of ``nav`` has its row."""
    linked = set(LINK.findall((DOCS / "index.md").read_text()))
    assert set(nav_pages()) - {"index.md"} <= {t.partition("#")[0] for t in linked}


def test_long_command_lines_wrap_instead_of_being_cut_at_the_column_edge(tmp_path: Path) -> None:
    """A code block's long command line is read whole: the site's stylesheet wraps it."""
    site = tmp_path / "site"
    assert build(site).returncode == 0
    css = [s for s in yaml.safe_load((REPO / "mkdocs.yml").read_text()).get("extra_css", [])]
    assert css, "mkdocs.yml names no extra stylesheet"
    page = html_of(site, "operations.md").read_text()
    assert all(href in page for href in css)
    rules = " ".join((site / href).read_text() for href in css)
    assert re.search(r"pre\s*>\s*code[^{]*\{[^}]*white-space:\s*pre-wrap", rules), rules


def test_the_readme_says_what_its_distributed_example_prints_and_why(tmp_path: Path) -> None:
    """The counter batch with the bundled scripted policy scores 0: the README says so, with the figure."""
    run = subprocess.run(
        [sys.executable, "-m", "gym_runtime.cli", "run", "resources/counter/config.yaml"]
        + ["-i", "resources/counter/data/example.jsonl", "--repeats", "4", "-o", str(tmp_path / "o.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    printed = re.search(r"mean reward: [0-9.]+", run.stdout)
    assert run.returncode == 0 and printed, run.stdout + run.stderr
    section = README.read_text().split("Terminal 3", 1)[1].split("##", 1)[0]
    assert f"`{printed.group(0)}`" in section and "scripted" in section


def code_blocks(text: str, heading: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block under ``heading``, up to the next heading of any level."""
    blocks: list[tuple[str, str]] = []
    fence: tuple[str, list[str]] | None = None
    for line in text.split(heading, 1)[1].splitlines():
        if fence is None and line.startswith("#"):
            break
        if fence is None and line.startswith("```"):
            fence = (line[3:].strip(), [])
        elif fence is not None and line == "```":
            blocks.append((fence[0], "\n".join(fence[1]) + "\n"))
            fence = None
        elif fence is not None:
            fence[1].append(line)
    return blocks


def test_the_complete_sandbox_agent_runs_as_the_docs_write_it(tmp_path: Path) -> None:
    """docs/sandboxes.md's complete agent: its files written where their first line says, its commands run in
    that folder as written, on the real engine (a skip without one)."""
    docker_socket()  # a skip without an engine (a failure under GYM_REQUIRE_DOCKER=1)
    blocks = code_blocks((DOCS / "sandboxes.md").read_text(), "### A complete agent")
    assert [lang for lang, _ in blocks] == ["python", "yaml", "bash"]
    for _, body in blocks[:2]:
        name = body.splitlines()[0].removeprefix("# ").strip()
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    script = blocks[2][1]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stdout + res.stderr
    promised = re.search(r"# (mean reward: [0-9.]+)", script)
    assert promised and promised.group(1) in res.stdout, res.stdout
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["reward"], r["printed"], r["exit_code"]) for r in rows] == [(1.0, "42", 0)]
    assert "sandbox_wait_s" in rows[0]


def test_the_verifiers_04_rows_command_writes_the_rows_the_docs_describe(tmp_path: Path) -> None:
    """docs/bring-your-environment.md's command for a 0.4 taskset's rows (prepare cannot list one), as written."""
    text = (DOCS / "bring-your-environment.md").read_text()
    ((lang, script),) = code_blocks(text, "**Tasks.** A row's `verifiers.index`")
    assert lang == "bash"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (tmp_path / "vf04.jsonl").read_text().splitlines()]
    assert rows[0] == {"responses_create_params": {"input": []}, "verifiers": {"index": 0}}
    assert [r["verifiers"]["index"] for r in rows] == list(range(100))


def test_the_inputs_the_deploy_recipes_name_are_in_the_repository() -> None:
    """`-i /work/tasks.jsonl` in the Compose commands reads ./deploy/work (mounted at /work): it must be there."""
    named = set()
    for doc in [DOCS / "deployment.md", *sorted((REPO / "deploy").glob("compose*.yaml"))]:
        named |= set(re.findall(r"-i /work/(\S+)", doc.read_text()))
    assert named
    for name in named:
        rows = (REPO / "deploy" / "work" / name).read_text().splitlines()
        assert rows and all(json.loads(r)["responses_create_params"]["input"] for r in rows), name


def test_the_readmes_distributed_example_and_the_async_recipe_write_under_runs() -> None:
    """Issue 75: what a documented path writes goes under the clone's runs/ (git ignores it), not its root."""
    assert "/runs/" in (REPO / ".gitignore").read_text().split()
    readme = "\n".join(body for _, body in code_blocks(README.read_text(), "## Run distributed"))
    outputs = re.findall(r"-o (\S+)", readme)
    assert outputs and all(o.startswith("runs/") for o in outputs), outputs
    page = (REPO / "docs/trainer.md").read_text()
    recipe = "\n".join(body for _, body in code_blocks(page, "## Recipe: TRL asynchronous GRPO"))
    written = re.findall(r'(?:save_for_rows\(|output_dir=|SyncClient\()"([^"]+)"', recipe)
    assert len(written) == 3 and all(w.startswith("runs/") for w in written), written
