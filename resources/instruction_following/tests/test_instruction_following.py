"""instruction_following against NeMo Gym's recorded rollouts and differential cases, plus every checker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gym_runtime.messages import (
    FunctionCall,
    Message,
    Reasoning,
    Response,
    assistant_message,
    last_item_text,
)
from gym_runtime.resources.instruction_following import (
    InstructionFollowing,
    grade,
    verifier_metadata,
)
from gym_runtime.resources.instruction_following.checkers import (
    CHECKERS,
    follow_list,
    follows,
    punkt_sentences,
    regex_sentences,
    word_tokens,
)
from tests.differential import (
    COMPAT,
    differential_cases,
    example_rollouts,
    read_jsonl,
    reverify_differential,
    reverify_rollouts,
    text_response,
    verify_once,
)

ENV_DIR = Path(__file__).resolve().parents[1]
NEMO = COMPAT / "nemo_gym" / "instruction_following"
FIELDS = {"follow_all_instructions", "follow_instruction_list"}


def check(instruction_id: str, kwargs: dict[str, Any] | None, text: str) -> bool:
    return follows(instruction_id, kwargs, text)


# ------------------------------------------------------------------ parity


async def test_recorded_rollouts_reverify_to_recorded_reward_and_fields() -> None:
    pairs = example_rollouts(ENV_DIR, NEMO)
    assert len(pairs) == 5
    await reverify_rollouts(InstructionFollowing, pairs, FIELDS)


async def test_differential_cases_reproduce_nemo_gym() -> None:
    await reverify_differential(InstructionFollowing, "instruction_following", at_least=48, tolerance=1e-9)


def test_every_instruction_id_of_the_data_has_a_checker() -> None:
    rows = read_jsonl(ENV_DIR / "data" / "example.jsonl") + [c for _, c in differential_cases("instruction_following")]
    ids = {i for row in rows for i in verifier_metadata(row)["instruction_id_list"]}
    assert ids - set(CHECKERS) == {"keywords:does_not_exist"}  # the differential data's unknown id
    assert len(CHECKERS) == 54


# ------------------------------------------------------------------ grading and text selection


def test_binary_and_fraction_grading() -> None:
    meta = {
        "instruction_id_list": ["punctuation:no_comma", "punctuation:punctuation_dot"],
        "kwargs": [None, {}],
        "prompt": "p",
    }
    assert grade(meta, "a, b") == (0.0, False, [False, True])
    assert grade({**meta, "grading_mode": "fraction"}, "a, b") == (0.5, False, [False, True])
    assert grade({**meta, "grading_mode": "fraction"}, "a b") == (1.0, True, [True, True])
    empty = {"instruction_id_list": [], "kwargs": [], "prompt": "p"}
    assert grade(empty, "x") == (1.0, True, [])  # all([]) as upstream
    assert grade({**empty, "grading_mode": "fraction"}, "x") == (0.0, True, [])


def test_verifier_metadata_wins_over_legacy_top_level_fields() -> None:
    row = {
        "id": 1,
        "instruction_id_list": ["a"],
        "prompt": "top",
        "kwargs": [{}],
        "grading_mode": "fraction",
        "verifier_metadata": {"instruction_id_list": ["b"], "prompt": "nested", "kwargs": [None]},
    }
    meta = verifier_metadata(row)
    assert (meta["instruction_id_list"], meta["prompt"], meta["grading_mode"]) == (["b"], "nested", "fraction")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"id": 1, "instruction_id_list": [], "kwargs": []}, "prompt"),
        ({"id": 1, "verifier_metadata": {"prompt": "p", "kwargs": []}}, "instruction_id_list"),
        ({"id": 1, "instruction_id_list": [], "kwargs": [], "prompt": "p", "grading_mode": "partial"}, "grading_mode"),
        ({"id": 1, "instruction_id_list": [], "kwargs": [], "prompt": "p", "grading_mode": None}, "grading_mode"),
        ({"id": 1, "instruction_id_list": "x", "kwargs": [], "prompt": "p"}, "lists"),
    ],
)
async def test_invalid_rows_are_refused(row: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await verify_once(InstructionFollowing, row, text_response("x"))


def test_only_the_first_part_of_the_last_item_is_checked() -> None:
    two_parts = Message(
        role="assistant", content=[{"type": "output_text", "text": "first"}, {"type": "output_text", "text": "second"}]
    )
    response = Response(id="r", created_at=0.0, output=[assistant_message("earlier"), two_parts])
    assert last_item_text(response.output) == "first"
    call = FunctionCall(name="f", arguments="{}", call_id="c")
    assert last_item_text([assistant_message("text"), call]) == ""
    reasoning = Reasoning(content=[{"type": "reasoning_text", "text": "thinking"}])
    assert last_item_text([reasoning]) == "thinking"
    assert last_item_text([Reasoning()]) == ""
    assert last_item_text([]) == ""


async def test_verify_runs_off_the_event_loop_and_returns_the_fields() -> None:
    row = {
        "id": 1,
        "instruction_id_list": ["detectable_format:title", "keywords:does_not_exist"],
        "kwargs": [None, {}],
        "prompt": "p",
        "grading_mode": "fraction",
    }
    v = await verify_once(InstructionFollowing, row, text_response("<<Hi>> there"))
    assert (v.reward, v.fields) == (0.5, {"follow_all_instructions": False, "follow_instruction_list": [True, False]})


# ------------------------------------------------------------------ arguments


def test_argument_handling() -> None:
    assert check("punctuation:no_comma", None, "a b")
    assert check("punctuation:no_comma", {"unused": None}, "a b")  # null arguments are dropped
    assert not check("punctuation:no_comma", {"unused": 1}, "a b")  # unknown arguments are an error
    assert not check("length_constraints:number_words", {"relation": "at least"}, "a b")  # missing: not random
    assert not check("length_constraints:number_words", {"num_words": 1, "relation": "more than"}, "a b")
    assert not check("length_constraints:number_words", {"num_words": "1", "relation": "at least"}, "a b")
    assert not check("keywords:existence", {"keywords": ["(unclosed"]}, "x")  # a bad regex is an error
    assert not check("no:such_id", {}, "x")
    assert not check(["not", "hashable"], {}, "x")  # type: ignore[arg-type]
    assert follow_list(["punctuation:no_comma", "punctuation:punctuation_dot"], [None], "x") == [True]


# ------------------------------------------------------------------ every checker

CASES: list[tuple[str, dict[str, Any] | None, str, bool]] = [
    ("keywords:existence", {"keywords": ["river", "stone"]}, "The riverside path of flagstones.", True),
    ("keywords:existence", {"keywords": ["river", "stone"]}, "The river path.", False),
    ("keywords:frequency", {"keyword": "data", "frequency": 3, "relation": "at least"}, "Data, data, database", True),
    ("keywords:frequency", {"keyword": "data", "frequency": 3, "relation": "less than"}, "Data, data, database", False),
    ("keywords:forbidden_words", {"forbidden_words": ["part"]}, "It is apart from us.", True),
    ("keywords:forbidden_words", {"forbidden_words": ["part"]}, "A PART of it.", False),
    ("keywords:letter_frequency", {"letter": "Z", "let_frequency": 2, "let_relation": "at least"}, "Zebra dozed", True),
    ("keywords:letter_frequency", {"letter": "zz", "let_frequency": 2, "let_relation": "at least"}, "zzz", False),
    (
        "language:response_language",
        {"language": "fr"},
        "Le petit village se trouve au bord de la rivière et les habitants se lèvent tôt.",
        True,
    ),
    ("language:response_language", {"language": "de"}, "The small village lies on the bank of the river.", False),
    ("language:response_language", {"language": "xx"}, "anything", False),  # not a supported language code
    ("language:response_language", {"language": "en"}, "12345 !!!", True),  # undetectable counts as followed
    (
        "length_constraints:number_sentences",
        {"num_sentences": 3, "relation": "less than"},
        "Mr. Smith went to Washington. He stayed.",
        True,
    ),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": "at least"}, "One. Two! Three?", True),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": "at least"}, "Dr. Who met Mr. X.", False),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "one\n***\ntwo\n***", True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "one\n***\n\n***\ntwo", False),
    ("length_constraints:number_words", {"num_words": 5, "relation": "less than"}, "it's a well-known fact", False),
    ("length_constraints:number_words", {"num_words": 10, "relation": "at least"}, " ".join(["w"] * 10), True),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "Crash"},
        'Start here.\n\n"Crash!" it went.',
        True,
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 3, "nth_paragraph": 2, "first_word": "crash"},
        "Start here.\n\nCrash it went.",
        False,
    ),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[name] lives at [address]", True),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[name] lives here", False),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Body.\n\nP.S. see you", True),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Body.\np. p. s: later", True),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Body.\nPS see you", False),
    ("detectable_format:number_bullet_lists", {"num_bullets": 3}, "* a\n* b\n- c\n**bold**", True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n* b\n* c", False),
    ("detectable_format:constrained_response", None, "Let me think. My answer is maybe. Probably.", True),
    ("detectable_format:constrained_response", None, "my answer is yes.", False),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**", True),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and ** **", False),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\nIntro\nSection 2\nEnd",
        True,
    ),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "SECTION", "num_sections": 3},
        "SECTION 1\nIntro\nSECTION 2\nEnd",
        False,
    ),
    ("detectable_format:json_format", None, '```json\n{"a": 1}\n```', True),
    ("detectable_format:json_format", None, 'Here: {"a": 1}', False),
    ("detectable_format:title", None, "<<Poem of Joy>>\ntext", True),
    ("detectable_format:title", None, "<< >>\ntext", False),
    ("combination:two_responses", None, "First.\n******\nSecond.", True),
    ("combination:two_responses", None, "Same.\n******\nSame.", False),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a haiku."}, "write a haiku. Rain falls.", True),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a haiku."}, "Sure! Write a haiku.", False),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, '"Done. any other questions?"', True),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Any other questions? Bye.", False),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 3, "capital_relation": "at least"},
        "NASA and the USA met the EU.",
        True,
    ),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "less than"},
        "I met NASA people.",
        False,
    ),
    ("change_case:english_capital", None, "THE WEATHER TODAY IS SUNNY AND WARM WITH A LIGHT BREEZE.", True),
    ("change_case:english_capital", None, "THE WEATHER TODAY IS SUNNY and WARM.", False),
    ("change_case:english_lowercase", None, "the weather today is sunny and warm with a light breeze.", True),
    ("change_case:english_lowercase", None, "The weather today is sunny.", False),
    ("punctuation:no_comma", None, "Red green and blue", True),
    ("punctuation:no_comma", None, "Red, green", False),
    ("startend:quotation", None, '  "Hello there."  ', True),
    ("startend:quotation", None, '"', False),
    (
        "copy:repeat_phrase",
        {"phrase": "The early bird catches the worm", "small_n": 2},
        "The early cat catches the worm. The early bird eats the worm.",
        True,
    ),
    (
        "copy:repeat_phrase",
        {"phrase": "The early bird catches the worm", "small_n": 2},
        "The early bird catches the worm. The early bird catches the worm.",
        False,
    ),  # no word replaced
    ("copy:copy", {"prompt_to_repeat": "Say hi."}, "  say HI.  ", True),
    ("copy:copy", {"prompt_to_repeat": "Say hi."}, "Say hi. Hi!", False),
    ("new:copy_span_idx", {"prompt_to_repeat": "Hello brave new world", "n_start": 6, "n_end": 15}, "brave new", True),
    ("new:copy_span_idx", {"prompt_to_repeat": "Hello brave new world", "n_start": 0, "n_end": 5}, "Hello", True),
    ("new:copy_span_idx", {"prompt_to_repeat": "Hello brave new world", "n_start": 6}, "brave new", False),
    ("detectable_format:sentence_hyphens", None, "I came.-I saw.-I won.", True),
    ("detectable_format:sentence_hyphens", None, "I came. - I saw.", False),
    ("keywords:no_adjacent_consecutive", None, "cats bite fish", True),
    ("keywords:no_adjacent_consecutive", None, "a big cat", False),
    ("detectable_format:square_brackets", None, "[every] [word] [here]", True),
    ("detectable_format:square_brackets", None, "[every] word", False),
    ("keywords:word_once", {"keyword": "moon"}, "The Moon is bright.", True),
    ("keywords:word_once", {"keyword": "moon"}, "moon and honeymoon", False),
    (
        "keywords:word_count_different_numbers",
        {"keyword": "cat", "frequency": 2, "relation": "at least"},
        "cat cat",
        True,
    ),
    ("keywords:exclude_word_harder", {"keyword": "fast"}, "fast cars are breakfast.", True),  # only " fast "
    ("keywords:exclude_word_harder", {"keyword": "fast"}, "cars go fast here", False),
    ("paragraphs:paragraphs", None, "one\n***\ntwo", True),
    ("paragraphs:paragraphs", None, "one\n***\ntwo\n***\nthree", False),
    ("paragraphs:paragraphs2", None, "one\n\ntwo\n\n", True),
    ("paragraphs:paragraphs2", None, "one\n\n\n\ntwo", False),
    ("first_word:first_word_sent", {"first_word": "relationship"}, "Relationship first. Relationship again!", True),
    ("first_word:first_word_sent", {"first_word": "relationship"}, "Relationship first. Then more.", False),
    ("first_word:first_word_sent", {"first_word": ["relationship"]}, "Relationship first.", False),
    ("first_word:first_word_answer", {"first_word": "Indeed"}, "indeed we go now.", True),
    ("first_word:first_word_answer", {"first_word": "Indeed"}, "", False),
    ("last_word:last_word_sent", {"last_word": "now"}, "We go now. They leave now!", True),
    ("last_word:last_word_sent", {"last_word": ["now"]}, "We go now.", True),
    ("last_word:last_word_sent", {"last_word": "now"}, "We go now. They leave later.", False),
    ("last_word:last_word_answer", {"last_word": "contest"}, "like a contest.", True),
    ("last_word:last_word_answer", {"last_word": "contest"}, "a contest. The end.", False),
    ("detectable_format:bigram_wrapping", None, "<<I am>> <<at home>>", True),
    ("detectable_format:bigram_wrapping", None, "<<I am>> at home", False),
    ("copy:copying_simple", {"prompt_to_repeat": "Tell me a joke."}, "tell me a joke.", True),
    ("copy:copying_multiple", {"prompt_to_repeat": "Hi there.", "N": 2}, "Hi there.\n******\nhi there.", True),
    ("copy:copying_multiple", {"prompt_to_repeat": "Hi there.", "N": 3}, "Hi there.\n******\nHi there.", False),
    ("punctuation:punctuation_dot", None, "No dots here", True),
    ("punctuation:punctuation_dot", None, "A dot.", False),
    ("punctuation:punctuation_exclamation", None, "Calm", True),
    ("punctuation:punctuation_exclamation", None, "Wow!", False),
    ("count:lowercase_counting", {"N": 3}, "* apples are red\n* PEARS", True),
    ("count:lowercase_counting", {"N": 2}, "* apples are red", False),
    ("letters:letter_counting", {"N": 3, "relation": "at least"}, "abc", True),
    ("letters:letter_counting", {"N": 3, "relation": "less than"}, "abc", False),
    ("letters:letter_counting", {"N": 3, "relation": "at most"}, "a", False),
    ("letters:letter_counting2", {"letter": "a", "let_frequency": 2, "let_relation": "less than"}, "a cat", False),
    (
        "count:counting_composition",
        {"n_sent": 2, "n_words": 4},  # the final period is a word token
        "I like it. You do too.\n***\nWe are here. They are there.\n***\nHe is up. She is down.",
        True,
    ),
    (
        "count:counting_composition",
        {"n_sent": 2, "n_words": 4},
        "***\nI like it. You do too.\n***\nWe are here. They are there.\n***\nHe is up. She is down.",
        False,
    ),
    ("count:count_unique", None, "The cat saw the dog", True),
    ("count:count_unique", None, "The cat saw the cat", False),
    ("count:count_increment_word", {"keyword1": "sun", "keyword2": "moon"}, "sun moon moon", True),
    ("count:count_increment_word", {"keyword1": "sun", "keyword2": "moon"}, "sun moon", False),
    ("keywords:palindrome", None, "We drove a racecar", True),
    ("keywords:palindrome", None, "No such thing here", False),
    ("keywords:keyword_specific_position", {"keyword": "blue", "n": 2, "m": 3}, "Hi there. The sky blue is.", True),
    ("keywords:keyword_specific_position", {"keyword": "blue", "n": 2, "m": 3}, "Hi there. The blue sky.", False),
    ("keywords:start_end", None, "Hello world hello", True),
    ("keywords:start_end", None, "Hello world hello.", False),
]


@pytest.mark.parametrize(("instruction_id", "kwargs", "text", "expected"), CASES)
def test_checker(instruction_id: str, kwargs: dict[str, Any] | None, text: str, expected: bool) -> None:
    assert check(instruction_id, kwargs, text) is expected


def test_every_checker_has_a_positive_and_a_negative_case() -> None:
    seen: dict[str, set[bool]] = {}
    for instruction_id, _, _, expected in CASES:
        seen.setdefault(instruction_id, set()).add(expected)
    assert set(seen) == set(CHECKERS)
    one_sided = {"letters:letter_counting2", "keywords:word_count_different_numbers", "copy:copying_simple"}
    assert {i for i, v in seen.items() if len(v) < 2} == one_sided  # aliases of checkers tested both ways


def test_tokenizers_match_nltk_behaviour() -> None:
    text = 'Mr. Smith went to Washington D.C. yesterday. He said "hi!" and left. It costs $3.50, e.g. a lot.'
    assert punkt_sentences(text) == [
        "Mr. Smith went to Washington D.C. yesterday.",
        'He said "hi!"',
        "and left.",
        "It costs $3.50, e.g.",
        "a lot.",
    ]
    assert word_tokens('He said "hi!" I can\'t.') == ["He", "said", "``", "hi", "!", "''", "I", "ca", "n't", "."]
    assert regex_sentences("Dr. Who arrived at 3.30 p.m. today... Then he left! Ph.D. students stayed.") == [
        "Dr. Who arrived at 3.30 p.m. today...",
        "Then he left!",
        "Ph.D. students stayed.",
    ]
    assert regex_sentences("") == []


def test_offers_no_tools_the_answer_is_the_message() -> None:
    assert InstructionFollowing.tool_definitions() == []
