"""``view`` shows a rollout's branches as a tree (issue 78): the parent's page lists its branches by the turn they
branched at, each with its reward and a link; a branch's page links back to its parent and says at which turn. A
run names its batch in its ``_batch.json`` sidecar (``collect`` writes it): the rows' ``branch_of`` names it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gym_runtime.data.sidecars import batch_path
from tests.test_view import serve
from tests.view_rows import failure, row, write


def run_of(path: Path, batch: str, rows: list[dict], failures: list[dict] | None = None) -> Path:
    write(path, rows, failures)
    batch_path(path).write_text(json.dumps({"batch": batch, "manifest": None, "config": None}))
    return path


def test_a_rollouts_page_shows_its_branches_as_a_tree_and_a_branch_links_its_parent(tmp_path: Path) -> None:
    parent = run_of(tmp_path / "parent.jsonl", "p", [row(0, 0, 1.0), row(0, 1, 0.0)])
    kids = [row(0, r, reward) | {"branch_of": "p:0:0", "branch_turn": 2} for r, reward in enumerate([1.0, 0.0])]
    deeper = row(0, 0, 1.0) | {"branch_of": "p:0:0", "branch_turn": 5}
    failed = failure(0, 2, "invalid_task", "branch: no checkpoint") | {"branch_of": "p:0:0", "branch_turn": 2}
    branches = run_of(tmp_path / "branches.jsonl", "q", kids, [failed])  # a failure row names its parent too
    later = run_of(tmp_path / "later.jsonl", "r", [deeper])
    for s in serve(str(parent), str(branches), str(later)):
        status, _, body = s.get("/rollout/0/0/0")
        assert status == 200
        page = body.decode()
        tree = page.split('id="branch-tree"', 1)[1].split("</section>", 1)[0]
        assert "p:0:0 (this rollout)" in tree
        turns = re.findall(r"at turn (\d+): (\d+) branch", tree)
        assert turns == [("2", "3"), ("5", "1")], turns  # by turn, the failed branch counted
        for href, label in [("/rollout/1/0/0", "q:0:0"), ("/rollout/1/0/1", "q:0:1"), ("/rollout/2/0/0", "r:0:0")]:
            assert f'<a href="{href}">{label}</a>' in tree, tree
        assert tree.count("reward 1") == 2 and tree.count("reward 0") == 1 and "invalid_task" in tree, tree
        _, _, other = s.get("/rollout/0/0/1")  # the parent's sibling has no branches: no tree
        assert b'id="branches"' not in other
        _, _, body = s.get("/rollout/1/0/1")
        said = body.decode().split('id="branch-of"', 1)[1].split("</p>", 1)[0]
        assert '<a href="/rollout/0/0/0">p:0:0</a> at turn 2' in said, said
