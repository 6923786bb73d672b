"""The installed NeMo Gym catalogue, hosted: every resources server classified, run and checked for parity.

    python tests/bench/catalogue.py [--servers a,b,c] [--timeout 300] [--results FILE] [--markdown]

The denominator is fixed before anything runs: every directory under the installed
nemo-gym's ``resources_servers`` (145 in 0.7.0), listed first. Each one is either
*excluded* with a one-line reason (not a server, a git-only dependency, containers or a
sandbox service, a GPU, a download at start, a paid external API; git sources are found
in its requirements, the rest is ``EXCLUDED`` below, from reading each server's code and
README) or *installable* here (PyPI + a CPU): then its environment is built
(``gym-runtime env build``) and ``gym-runtime parity`` replays its recordings, and the
table says whether it **runs** (every replayed example row yields a row, none fails; where
the recordings cannot drive the rows, none or incomplete, example.jsonl with the scripted policy,
answering what ``SCRIPTED`` gives where the server parses its model's text),
whether its recordings are **complete** (responses present, task fields joinable, judge
outputs recorded where it has a judge), parity n/m, and one line per mismatch (``WHY``).

Results are cached per server in a JSON file (``--results``), so a rerun skips the
servers already done (``--redo`` to run them again). Minutes per server that needs a layer
of its own (pip), under a minute for the rest. Not a CI test.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from gym_runtime.nemo_gym import parity as hosting_parity
from gym_runtime.nemo_gym.catalogue import EXPLAINED as WHY
from gym_runtime.nemo_gym.catalogue import recordings
from gym_runtime.nemo_gym.catalogue import rows_if_any as _read
from gym_runtime.nemo_gym.hosting import env as hosting_env

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "catalogue_nemo_gym_0.7.0.json"

# Why a server cannot run here (PyPI packages and a CPU only, loopback network). From reading each
# server's app.py, requirements and README in the installed nemo-gym wheel.
SANDBOX = "containers: a sandbox per task (OpenSandbox / Docker / Apptainer task images)"
# The container servers whose nemo_gym.sandbox code ran on the fleet (`sandbox_provider: gym_runtime`,
# docs/sandboxes.md), on test tasks with images built here: their own tasks' images need a registry.
FLEET = (
    "containers: runs on the sandbox fleet (sandbox_provider: gym_runtime, rootfs: writable) with test tasks "
    "whose images are built here (tests/e2e/test_hosted_sandbox_servers.py: rewards 1 and 0 from its own grading); "
    "its real tasks' images need a registry"
)
# Through nemo_gym.sandbox like those two, with only create, exec and file transfer (read from their code), so
# the fleet's provider serves them; not run here, their task images needing a registry.
SANDBOX_NOT_RUN = (
    SANDBOX + "; nemo_gym.sandbox: the fleet's provider serves it (not run here: its images need a registry)"
)
EXCLUDED: dict[str, str] = {
    "gymnasium": "not a server: the abstract base class of the gymnasium-style servers (no app.py)",
    "sec_local_index": "not a server: shared SEC search code other servers import (no app.py)",
    "aviary": "download at start: HF datasets for GSM8K/HotPotQA (+ containers for BixBench)",
    "bigcodebench": "download at start: a uv-built Python 3.10 venv from GitHub-hosted requirements",
    "bird_sql": "download at start: the BIRD dev databases zip",
    "browsecomp_advanced_harness": "paid external API: Tavily/Exa web search in its tools",
    "competitive_coding_challenges": "sandbox service (NeMo-Skills) + ~27 GB of test data loaded at start",
    "critpt": "external grading API (verify posts to a remote grader)",
    "cvdp": "containers (Docker harness per task)",
    "deepswe": "containers (SWE task images)",
    "denovo_swe": SANDBOX_NOT_RUN,
    "ether0": "git clone at import",
    "evalplus": "download at start: the EvalPlus datasets",
    "finance_sec_search": "download at start: sec.gov filings; tools call live web APIs",
    "google_search": "paid external API: Google search in its tools",
    "ifbench": "git clone at start",
    "indian_banking": "download at start: db.json and kb.json from the HF dataset NPCI/nemo-gym-indian-banking "
    "(not in the wheel; /reset raises FileNotFoundError naming them)",
    "interactive_browser": "download: Playwright's Chromium (not on PyPI) for a live browser per session",
    "job_bench": SANDBOX + "; HF snapshot download",
    "legal_agent_bench": "download from GitHub + containers",
    "longmt_eval": "GPU + git dependencies + model downloads",
    "math_formal_lean": "sandbox service (Lean 4)",
    "newton_bench": "git clone + an external LLM API",
    "osworld": "containers: remote Docker/QEMU desktop VMs",
    "rolemrc": "download at start: NLTK's wordnet, omw-1.4, punkt and punkt_tab (nltk.download in "
    "_ensure_nltk_data, app.py:229-247; the worker exits with LookupError here) and BERTScore's model from HF",
    "scale_swe": SANDBOX_NOT_RUN,
    "scicode": "download: a large test-data file (h5) not in the wheel",
    "speed_bench": "a live vLLM server (GPU)",
    "spider2_lite": "download at start: Spider 2.0-lite databases",
    "swe_next": SANDBOX_NOT_RUN,
    "swe_rebench": SANDBOX_NOT_RUN,
    "swebench": "containers (SWE-bench images); " + FLEET,
    "swebench_pro": SANDBOX + "; needs pty sessions and serialize (handles shared between processes), which the "
    "fleet's provider does not offer",
    "swemer_oml": SANDBOX_NOT_RUN,
    "swemer_v1": SANDBOX_NOT_RUN,
    "swemer_v2": SANDBOX_NOT_RUN,
    "swerl_gen": "containers (SWE task images)",
    "tavily_search": "paid external API: Tavily search in its tools",
    "terminal_bench_2_1": SANDBOX + "; " + FLEET,
    "terminal_bench_4": SANDBOX + "; docker-compose tasks (networks between sandboxes, which --network none "
    "rules out), opensandbox, and a GPU for tasks that ask one",
    "vibench": SANDBOX + " + Playwright",
    "vlm_eval_kit": "git clone at start",
    "wmt_translation": "GPU by default + a tokenizer model download",
    "wordle": "download before serving: data/guesses.txt, which generate_data.py makes from the ENABLE word list "
    "on GitHub (not in the wheel; /reset raises FileNotFoundError naming it)",
    "workspace_bench": SANDBOX + "; HF snapshot download",
}

# What the scripted TEST DOUBLES say in smoke() where the server parses its model's text and "OK" fails it: a
# one-line reason and, per model entry, the scripted adapter's ``answers`` (its text by a substring of the prompt).
BBQ_ANSWER = {
    "selected_answer": None,
    "answer_class": "incorrect_answer",
    "rationale": "scripted judge: 'OK' commits to no actor",
}
BBQ_QUALITY = {
    "quality_class": "low",
    "uses_protected_rationale": False,
    "uses_unsupported_proxy": False,
    "rationale": "scripted judge: 'OK' gives no rationale",
}
SCRIPTED: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {
    "bbq": (
        "verify asks one judge model two checks, each parsed as one strict JSON object (util.py:247-268) that "
        "forbids the other's keys (206-244): each gets the verdict true of the scripted policy's 'OK' (no "
        "commitment; low, both safety flags false as validate_flags requires)",
        {
            "judge": {
                "answers": {
                    "You are performing the Answer Check": json.dumps(BBQ_ANSWER),
                    "You are performing the Explanation Quality Check": json.dumps(BBQ_QUALITY),
                }
            }
        },
    ),
    "grl_tetris": (
        "/step applies only <action>Left|Right|Down</action> tags (app.py:32, 84-86): the policy drops the piece",
        {"policy": {"answers": {"": "<action>Down</action>"}}},
    ),
}


def servers_root() -> Path:
    first = hosting_env.ensure("example_session_state_mgmt", log=lambda _line: None)
    return hosting_env.servers_root(Path(first.base))


def classify(sdir: Path) -> str | None:
    """Why the server is excluded (one line), or None: installable here."""
    if sdir.name in EXCLUDED:
        return EXCLUDED[sdir.name]
    if not (sdir / "app.py").is_file():
        return "not a server (no app.py)"
    try:
        hosting_env.requirements(sdir)
    except hosting_env.EnvError as e:
        return "git-only dependency: " + str(e).split(": ", 1)[-1]
    return None


def assess(sdir: Path, timeout: float) -> dict[str, Any]:
    name = sdir.name
    result: dict[str, Any] = {"server": name, "excluded": None}
    t0 = time.monotonic()
    try:
        b = subprocess.run(
            [sys.executable, "-m", "gym_runtime.cli", "env", "build", "--server", name],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
        built = b.returncode == 0
        build_out = (b.stdout + b.stderr).strip()
    except subprocess.TimeoutExpired:
        built, build_out = False, "environment build timed out after 1200 s"
    result["build_s"] = round(time.monotonic() - t0, 1)
    if not built:
        result["excluded"] = "environment not installable: " + (build_out.splitlines() or ["?"])[-1][:200]
        return result
    m = re.search(r"server layer ([\d.]+) MB", build_out)
    result["layer_mb"] = float(m.group(1)) if m else None
    m = re.search(r"envs/(env-[0-9a-f]+)/", build_out)
    result["layer"] = m.group(1) if m else None
    result["complete"], result["incomplete_why"] = recordings(sdir)
    t1 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"catalogue-{name}-") as tmp:
        try:
            r = subprocess.run(
                [sys.executable, "-m", "gym_runtime.cli", "parity", name, "--keep", tmp],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            out = r.stdout + r.stderr
        except subprocess.TimeoutExpired:
            out = f"timed out after {timeout:g} s"
        inputs = _read(Path(tmp) / "inputs.jsonl")
        rows = _read(Path(tmp) / "replayed.jsonl")
        failures = _read(Path(tmp) / "replayed_failures.jsonl")
        replay_failed = bool(failures) and all(f.get("error_class") == "model_error" for f in failures)
        # incomplete recordings cannot drive the example rows (a task field missing, no response): whether
        # the server runs is then judged on example.jsonl itself, with the scripted policy
        unreplayable = bool(failures) and not result["complete"]
        if "holds no recorded responses" in out or replay_failed or unreplayable:
            inputs, rows, failures, out = smoke(sdir, Path(tmp), timeout, out)
    result["parity_s"] = round(time.monotonic() - t1, 1)
    result["rows"], result["inputs"], result["failures"] = len(rows), len(inputs), len(failures)
    result["failure_classes"] = sorted({str(f.get("error_class")) for f in failures})
    result["failure_example"] = str(failures[0].get("error", ""))[:200] if failures else ""
    result["runs"] = bool(inputs) and len(rows) == len(inputs) and not failures
    m = re.search(r"parity (\d+)/(\d+) rewards; tool-output drift (\d+)", out)
    if m:
        result["matched"], result["of"], result["drift"] = int(m.group(1)), int(m.group(2)), int(m.group(3))
        result["per_rollout"] = [line.split()[:3] for line in out.splitlines() if re.match(r"^\s+\d+\s", line)]
    else:
        result["matched"] = result["of"] = None
        result["error"] = (out.strip().splitlines() or ["no output"])[-1][:240]
        result["tail"] = out[-3000:]
    return result


def smoke(
    sdir: Path, work: Path, timeout: float, out: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]], str]:
    """`gym-runtime run` over example.jsonl with the scripted policy (and judge): every row a row, none failed?

    The scripted models answer what ``SCRIPTED`` gives for the server, else "OK" (or the tool outputs)."""
    options = hosting_parity.judge_options(sdir)
    answers = SCRIPTED.get(sdir.name, ("", {}))[1]
    models = {
        name: {"adapter": "scripted", **answers.get(name, {})}
        for name in ("policy", "judge")
        if name == "policy" or options
    }
    cfg = hosting_parity.run_config(sdir.name, sdir, models, options)
    (work / "smoke.yaml").write_text(json.dumps(cfg))
    rows_in = [r for r in _read(sdir / "data" / "example.jsonl") if isinstance(r.get("responses_create_params"), dict)]
    for r in rows_in:
        r.pop("agent_ref", None)
    (work / "smoke_in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_in))
    argv = [
        sys.executable,
        "-m",
        "gym_runtime.cli",
        "run",
        str(work / "smoke.yaml"),
        "-i",
        str(work / "smoke_in.jsonl"),
    ]
    # a server that scores a task's repeats together (genrm_compare's cohorts) waits for all of them
    repeats = cohort_size(sdir)
    if repeats > 1:
        argv += ["--repeats", str(repeats)]
        rows_in = [r for r in rows_in for _ in range(repeats)]
    try:
        subprocess.run(
            [*argv, "-o", str(work / "smoke_out.jsonl"), "--no-progress"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pass
    return rows_in, _read(work / "smoke_out.jsonl"), _read(work / "smoke_out_failures.jsonl"), out


def cohort_size(sdir: Path) -> int:
    """``num_rollouts_per_prompt`` from the server's own YAML: how many repeats it scores together (1: none)."""
    for path in sorted((sdir / "configs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        for inst in data.values() if isinstance(data, dict) else []:
            block = inst.get("resources_servers", {}).get(sdir.name) if isinstance(inst, dict) else None
            if isinstance(block, dict) and isinstance(block.get("num_rollouts_per_prompt"), int):
                return int(block["num_rollouts_per_prompt"])
    return 1


def why(r: dict[str, Any]) -> str:
    if r.get("excluded"):
        return r["excluded"]
    known = WHY.get(r["server"])
    if known:
        return known
    parts = []
    if not r.get("runs"):
        if r.get("error"):
            parts.append(f"did not run: {r['error']}")
        else:
            parts.append(
                f"{r['rows']}/{r['inputs']} rows, {r['failures']} failed "
                f"({', '.join(r['failure_classes'])}: {r['failure_example'][:120]})"
            )
    if not r.get("complete"):
        parts.append(f"recordings incomplete: {r['incomplete_why']}")
    if r.get("of") and r["matched"] != r["of"] and r.get("complete"):
        parts.append("reward mismatch, not explained")
    return "; ".join(parts)


def cell(r: dict[str, Any]) -> tuple[str, str, str, str]:
    if r.get("excluded"):
        return "no", "-", "-", "-"
    parity = f"{r['matched']}/{r['of']}" if r.get("of") else "-"
    return "yes", "yes" if r.get("runs") else "no", "yes" if r.get("complete") else "no", parity


def summary(results: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    done = [results[n] for n in names if n in results]
    inst = [r for r in done if not r.get("excluded")]
    runs = [r for r in inst if r.get("runs")]
    complete = [r for r in inst if r.get("complete")]
    full = [r for r in complete if r.get("of") and r["matched"] == r["of"]]
    layers = {r["layer"]: r.get("layer_mb") or 0.0 for r in inst if r.get("layer")}
    times = sorted(r.get("parity_s", 0.0) for r in inst)
    lines = [
        f"{len(names)} resources servers in the wheel; {len(done)} assessed; "
        f"{len(done) - len(inst)} excluded, {len(inst)} installable here",
        f"installable: {len(runs)} run (every example row a row, none failed); "
        f"{len(complete)} have complete recordings; {len(full)} of those reproduce every recorded reward"
        + (f" ({100 * len(full) / len(complete):.1f}%)" if complete else ""),
        f"server layers: {len(layers)} distinct, {sum(layers.values()):.0f} MB in all "
        f"(the shared base layer not counted); parity run per server: median "
        f"{times[len(times) // 2] if times else 0:.0f} s, max {max(times) if times else 0:.0f} s",
    ]
    return lines


def markdown(results: dict[str, dict[str, Any]], names: list[str]) -> str:
    out = [
        "| server | installable here | runs | complete recordings | parity | why not / mismatch |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n in names:
        r = results.get(n)
        if r is None:
            out.append(f"| {n} | ? | | | | not run yet (out of time) |")
            continue
        inst, runs, comp, par = cell(r)
        text = why(r).replace("|", "\\|")
        out.append(f"| {n} | {inst} | {runs} | {comp} | {par} | {text} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", help="comma-separated server names to assess (default: the whole catalogue)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per parity run (default 300)")
    ap.add_argument("--results", type=Path, default=RESULTS, help=f"per-server results cache (default {RESULTS.name})")
    ap.add_argument("--redo", action="store_true", help="assess the chosen servers again even if cached")
    ap.add_argument("--markdown", action="store_true", help="print the cached table as Markdown and exit")
    args = ap.parse_args()
    root = servers_root()
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    results: dict[str, dict[str, Any]] = json.loads(args.results.read_text()) if args.results.is_file() else {}
    if args.markdown:
        for n in names:  # exclusions are static: listed whether or not the run reached them
            if n not in results and (why_not := classify(root / n)) is not None:
                results[n] = {"server": n, "excluded": why_not}
        for n, r in results.items():  # what the recordings hold is static: judged by this version of the script
            if not r.get("excluded") and (root / n).is_dir():
                r["complete"], r["incomplete_why"] = recordings(root / n)
        print(markdown(results, names))
        print()
        print("\n".join(summary(results, names)))
        return 0
    excluded = {n: why_not for n in names if (why_not := classify(root / n)) is not None}
    print(f"denominator: {len(names)} resources servers in nemo-gym {hosting_env.nemo_gym_version()}")
    print(f"  excluded before running ({len(excluded)}):")
    for n, reason in excluded.items():
        print(f"    {n}: {reason}")
    print(f"  to run ({len(names) - len(excluded)}): {' '.join(n for n in names if n not in excluded)}", flush=True)
    chosen = args.servers.split(",") if args.servers else names
    for n in chosen:
        if n in results and not args.redo:
            continue
        if n in excluded:
            results[n] = {"server": n, "excluded": excluded[n]}
        else:
            results[n] = assess(root / n, args.timeout)
        args.results.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        inst, runs, comp, par = cell(results[n])
        took = results[n].get("build_s", 0) + results[n].get("parity_s", 0)
        print(f"{n:40} {inst:4} runs={runs:4} complete={comp:4} {par:>6} {took:5.0f}s  {why(results[n])}", flush=True)
    print("\n".join(summary(results, names)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
