"""What is known of NeMo Gym's catalogue, server by server: why a server's recordings cannot be replayed,
and why its replayed rewards differ from the recorded ones where the cause was found (by reading the
server's code in the nemo-gym 0.7.0 wheel). ``gym-runtime parity`` says these reasons, and
``tests/bench/catalogue.py`` writes them into docs/nemo-gym.md's catalogue table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gym_runtime.nemo_gym import parity

# One line per server whose replayed rewards differ from the recording (or that does not run, or cannot be
# replayed at all), where the cause is known. Servers missing here print "not explained".
EXPLAINED: dict[str, str] = {
    "blackjack": "unseeded RNG: reset() deals from `random.Random()` with no seed (app.py:55), so every replay's "
    "cards differ from the recording's and the replayed policy's next recorded move has no matching state",
    "mcqa": "grader changed after the recording: rollout 2 answers `\\boxed{\\nC: <option text>\\n}` (expected C), "
    "recorded 0 with no extracted_answer; the wheel's strict boxed parser takes a leading letter with option text "
    "after it (app.py:92-97, `\\boxed{E: ...}`), replayed 1",
    "workplace_assistant": "rollouts lack ground_truth and example.jsonl no longer holds the recorded tasks",
    "gdpval": "recorded with stirrup_agent (a system item inside the output), which agents.simple cannot replay",
    "bbq": "no parity possible: no recorded responses or judge calls; runs on example.jsonl with a scripted judge "
    "(SCRIPTED): each of its two checks answers the verdict true of the scripted policy's 'OK' (no commitment; a low "
    "explanation), so every reward is 0 x 0.5 = 0: it shows the server runs, not how it scores",
    "text_to_sql": "grader changed after the recording: the judge's system message (prompts.py:19, "
    "SQL_JUDGE_SYSTEM_MESSAGE) was rewritten since; every recorded judge request holds the old one ('would "
    "produce identical result sets'), so no recorded verdict answers today's request (judge_failed, reward 0); "
    "the user prompt, rebuilt from the row and the wheel's template, is the recorded one",
    "math_advanced_calculations": "recorded with an older NeMo Gym: every rollout's responses_create_params holds "
    "`tool_choice: null`, which 0.7.0's verify request model refuses (HTTP 422, literal 'none'/'auto'/'required'), "
    "and the recorded tasks are no longer in example.jsonl; on example.jsonl it runs",
    "grl_tetris": "unseeded RNG: TetrisEnv.__init__ calls reset() unseeded (tetris_env/tetris_env.py:127), which "
    "draws 17 pieces from the process's `random` and leaves the shape counts that weight the seeded reset's draws "
    "(lines 132-133; reset does not clear them): seed 60494's first board is `__XX` or `XX__` by process (3 of 6 "
    "fresh processes each; recorded `__XX`); the diverged rollouts' boards have no recorded answer, so it runs on "
    "example.jsonl, the scripted policy dropping each piece (SCRIPTED: `<action>Down</action>`; /step refuses a "
    "text with no `<action>` tag, HTTP 400)",
    "lc_niah": "grader changed after the recording: every recorded reasoning_overlap is the LCS overlap (its "
    "overlap_lcs field), the wheel computes ngram16 (app.py:66, configs/lc_niah.yaml); rollout 0: 1 x (1 - 0.0123) "
    "= 0.9877 recorded, 1 x (1 - 0) = 1 replayed",
    "math_with_judge": "load-dependent (5/5 at load 1.5, 4/5 at load 10-13, 2026-11-25): math_verify compares "
    "rollout 1's (2+-sqrt3)^2016 forms under a 5 s "
    "wall-clock alarm (math-verify 0.8.0, grader.py:750); it needs 3.1 s of CPU here, 7.8 s at load 13 on 2 cores: "
    "`Timeout during comparison`, library_reward 0 (recorded 1); should_use_judge is false, so no judge makes up "
    "for it",
}

# Recordings that hold every field but are not an agent's rollouts (from reading the server's own code): counted
# as incomplete recordings, with the reason.
NOT_ROLLOUTS: dict[str, str] = {
    "openair_congestion": "written by the server's generate_example_rollouts.py, a scripted policy posting /reset "
    "and /step itself (no agent, no model): `response` holds only the last step's action, the first one is only "
    "in `trajectory`; that script, run here on the installed server, reproduces all 5 rewards",
}


# Recordings complete but for the judge: ``parity`` replays them, refusing only the rows whose replay called it.
NO_JUDGE_CALL = "it has a judge, but no judge call is recorded"


def rows_if_any(path: Path) -> list[dict[str, Any]]:
    """A JSONL file's rows; none where the file is missing."""
    return parity.read_rows(path) if path.is_file() else []


def recordings(sdir: Path) -> tuple[bool, str]:
    """Complete recordings? (responses present, task fields joinable, judge outputs recorded) and why not."""
    if sdir.name in NOT_ROLLOUTS:
        return False, NOT_ROLLOUTS[sdir.name]
    data = sdir / "data"
    rows = rows_if_any(data / "example_rollouts.jsonl")
    lines = [ln for ln in (data / "example_rollouts.jsonl").read_text().split("\n") if ln.strip()]
    with_response = [r for r in rows if isinstance(r.get("response"), dict) and r["response"].get("output")]
    if not lines or len(with_response) < len(lines):
        placeholders = sum(1 for ln in lines if "PLACEHOLDER" in ln)
        what = f"; {placeholders} placeholder rows" if placeholders else ""
        return False, f"responses missing ({len(with_response)}/{len(lines)} rows have one{what})"
    examples = rows_if_any(data / "example.jsonl")
    task_keys = (
        set().union(*(set(e) for e in examples)) - {"responses_create_params", "agent_ref"} if examples else set()
    )
    mat = {
        (r.get("_ng_task_index"), r.get("_ng_rollout_index"))
        for r in rows_if_any(data / "example_rollouts_materialized_inputs.jsonl")
    }
    prompts = {parity._prompt(e) for e in examples}
    joined = sum(
        1
        for r in rows
        if (r.get("_ng_task_index"), r.get("_ng_rollout_index")) in mat
        or parity._prompt(r) in prompts
        or task_keys <= set(r)
    )
    if joined < len(rows):
        return False, f"task fields not joinable ({joined}/{len(rows)} rows)"
    if parity.judge_option(sdir) is not None:
        # a row whose judge left output (a judge_* or rubric field with a value) must hold the call itself
        text_only = [
            r
            for r in rows
            if not parity.judge_recordings([r])
            and any(("judg" in k or "rubric" in k) and v not in (None, "", [], {}) for k, v in r.items())
        ]
        if text_only:
            return False, f"judge kept as text only, no request to replay ({len(text_only)}/{len(rows)} rows)"
        if not parity.judge_recordings(rows):
            return False, NO_JUDGE_CALL
    return True, ""
