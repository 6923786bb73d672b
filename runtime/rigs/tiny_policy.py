"""A tiny random-weight chat model and word-level tokenizer, built offline (no hub): the policy the trainer tests
train, and the one docs/trainer.md's recipes build (``save_for_rows``) so a recipe runs as written on a laptop.
A 2-layer Qwen2-shaped config; one token per word, per punctuation run, per special token, and one for
each whole tool call given (so a random policy calls a tool with a chance of about one in the vocabulary's size
per token); a Qwen-style chat template with tools and Hermes tool calls (what the ``transformers`` adapter parses).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
ROLES = ["system", "user", "assistant", "tool", "tools:"]

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system tools: {% for t in tools %}"
    "{{ t.function.name if t.function is defined else t.name }} {% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant {% if m.content %}{{ m.content }}{% endif %}"
    "{%- for tc in (m.tool_calls or []) %}"
    '<tool_call>{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def tool_call_text(name: str, arguments: dict[str, Any] | None = None) -> str:
    """A Hermes tool call exactly as the template renders it (one token of the tokenizer when listed)."""
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments or {})}}}</tool_call>'


def build_tokenizer(words: list[str], tool_calls: list[str] = ()) -> Any:  # type: ignore[assignment]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for w in [*SPECIALS, *ROLES, "hi", "ok", *words]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens(list(tool_calls))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(vocab_size: int, *, seed: int = 0, hidden: int = 32, layers: int = 2) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(config)


def build(
    words: list[str],
    tool_calls: list[str] = (),  # type: ignore[assignment]
    *,
    seed: int = 0,
    tool_bias: float = 0.0,
) -> tuple[Any, Any]:
    """(model, tokenizer): in process, for a trainer that registers them as a live model. ``tool_bias``: a
    trainable output bias that much above the others on the tool-call tokens (a policy that calls tools)."""
    import torch

    tokenizer = build_tokenizer(words, tool_calls)
    model = build_model(len(tokenizer), seed=seed)
    bias = torch.zeros(len(tokenizer))
    for text in tool_calls:
        bias[tokenizer.convert_tokens_to_ids(text)] = tool_bias
    model.lm_head.bias = torch.nn.Parameter(bias)  # nn.Linear adds it to every logit
    return model, tokenizer


def save(path: Path, words: list[str], tool_calls: list[str] = (), *, seed: int = 0) -> Path:  # type: ignore[assignment]
    """The same, saved as a model directory (``adapter: transformers`` with ``model: DIR``)."""
    model, tokenizer = build(words, tool_calls, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def words_of(rows: list[dict[str, Any]]) -> list[str]:
    """Every word and punctuation run of the rows' prompts and tool names (what the tokenizer's pre-tokenizer
    splits), so a prompt is in the vocabulary rather than ``[UNK]``s."""
    seen: dict[str, None] = {}
    for row in rows:
        params = row.get("responses_create_params") or {}
        messages = params.get("input")
        texts = [messages] if isinstance(messages, str) else [str(m.get("content") or "") for m in messages or []]
        texts += [str(t.get("name") or "") for t in params.get("tools") or []]
        for text in texts:
            seen.update(dict.fromkeys(re.findall(r"\w+|[^\w\s]+", text)))
    return list(seen)


def save_for_rows(path: str | Path, rows: list[dict[str, Any]], *, seed: int = 0) -> str:
    """``save`` with the rows' words as the vocabulary (``words_of``): a model directory ``from_pretrained`` reads,
    for a recipe's first run with no checkpoint or network. Returns the directory's path."""
    save(Path(path), words_of(rows), seed=seed)
    return str(path)
