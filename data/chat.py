"""Fine-tuning data (data.format: chat): conversations as token ids plus a mask of the tokens to train on.

A record is `{"messages": [{"role": ..., "content": ...}]}` or a prompt/response pair (field names from the
config), rendered by a chat template and tokenised; the mask is 1 on the assistant's tokens, the end of each of its
turns included. The tokenizer's own template (data.tokenizer: hf) marks the assistant's characters with its
`{% generation %}` tags, or else each assistant turn is found by rendering the conversation incrementally; ours,
PLAIN (SentencePiece models have none), tokenises each part on its own, with `<|end|>` as a text marker so the only
EOS of a conversation separates it from the next. The templates and the rules: docs/training.md."""
from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import first_line

ROLES = ("system", "user", "assistant")
PLAIN_END = "<|end|>"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


# CPU seconds a tokenizer's chat template may take to render (and tokenize) one conversation, plus this many per MB
# of its messages' content: far beyond what a real template needs; one past it loops without end (nested range()
# loops) or builds text without bound, and would hold the preparation forever, conversation after conversation.
RENDER_SECONDS = 10.0
RENDER_SECONDS_PER_MB = 1.0


class BadConversation(ValueError):
    """A record that is not a usable conversation (a bad record: data.on_bad_record decides)."""


class TemplateUnusable(BadConversation):
    """The template itself fails, whatever the conversation: an error for the whole corpus, not one record."""


class TemplateNotIncremental(TemplateUnusable):
    """The template cannot give the assistant's spans (see the module docstring)."""


class _OutOfTime(BaseException):
    """Raised into a render past its CPU time: not an Exception, so no `except Exception` of jinja's or transformers'
    takes it for a template error of its own."""


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, str]]
    where: str  # file and line, for messages


@dataclass(frozen=True)
class ChatFields:
    """Where a record keeps its conversation: a list of messages, or a prompt and a response."""

    messages: str = "messages"
    prompt: str = "prompt"
    response: str = "response"


def conversation(record: object, fields: ChatFields) -> list[dict[str, str]]:
    """The record's messages as [{"role", "content"}], checked; BadConversation says what is wrong."""
    if not isinstance(record, dict):
        raise BadConversation("expected a JSON object")
    if fields.messages in record:
        messages = record[fields.messages]
        if not isinstance(messages, list) or not messages:
            raise BadConversation(f"'{fields.messages}' must be a non-empty list of messages")
        out = []
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            content = message.get("content") if isinstance(message, dict) else None
            if role not in ROLES or not isinstance(content, str):
                raise BadConversation(f"message {i} must be an object with a role ({', '.join(ROLES)}) and a "
                                      f"string content")
            out.append({"role": role, "content": content})
    elif isinstance(record.get(fields.prompt), str) and isinstance(record.get(fields.response), str):
        out = [{"role": "user", "content": record[fields.prompt]},
               {"role": "assistant", "content": record[fields.response]}]
    else:
        raise BadConversation(f"expected a list '{fields.messages}', or string fields '{fields.prompt}' and "
                              f"'{fields.response}'")
    if not any(m["role"] == "assistant" for m in out):
        raise BadConversation("no assistant message: nothing to train on")
    if out[0]["role"] == "assistant":
        raise BadConversation("the conversation starts with the assistant's message: no prompt to answer")
    return out


def canonical_text(messages: list[dict[str, str]]) -> str:
    """The conversation as text that depends only on its content: the hash of its UTF-8 picks its split."""
    return json.dumps(messages, ensure_ascii=False, sort_keys=True)


def plain_segments(messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """The PLAIN template's parts as (text, trained?), in order."""
    parts: list[tuple[str, bool]] = []
    for message in messages:
        header = f"<|{message['role']}|>\n"
        if message["role"] == "assistant":
            parts += [(header, False), (message["content"] + PLAIN_END, True), ("\n", False)]
        else:
            parts.append((header + message["content"] + "\n", False))
    return parts


def plain_text(messages: list[dict[str, str]]) -> str:
    """The conversation as the PLAIN template renders it (what a SentencePiece tokenizer is trained on)."""
    return "".join(text for text, _ in plain_segments(messages))


def plain_prompt(encode, messages: list[dict[str, str]]) -> list[int]:
    """The context for generating the assistant's next turn with the PLAIN template: the conversation so far, then the
    assistant's header, each part tokenised on its own as render_plain tokenises the training data (encode as there)."""
    ids, _ = render_plain(encode, messages)
    return ids + encode([plain_segments([{"role": "assistant", "content": ""}])[0][0]])[0]


def render_plain(encode, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(token ids, mask) with the PLAIN template; encode(list[str]) -> list[list[int]] tokenises each part."""
    segments = plain_segments(messages)
    ids: list[int] = []
    mask: list[int] = []
    for (_, trained), part in zip(segments, encode([text for text, _ in segments]), strict=True):
        ids += part
        mask += [int(trained)] * len(part)
    return ids, mask


def has_generation_tags(template: str) -> bool:
    return bool(_GENERATION_TAG.search(template))


def render_template(tok, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(token ids, mask) with a transformers tokenizer's own chat template (see the module docstring). Rendering is
    bounded in CPU time (RENDER_SECONDS): a template past it is TemplateUnusable."""
    seconds = RENDER_SECONDS + RENDER_SECONDS_PER_MB * sum(len(m["content"]) for m in messages) / 2**20
    try:
        with _cpu_time_limit(seconds):
            if has_generation_tags(tok.get_chat_template()):
                out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
                return list(out["input_ids"]), list(out["assistant_masks"])
            text, spans = _assistant_spans(tok, messages)
    except _OutOfTime:
        raise TemplateUnusable(f"the chat template of the tokenizer in {tok.name_or_path} took more than {seconds:.3g} "
                               f"s of CPU time to render one conversation (a loop without end?): fix the template, or "
                               f"set data.chat_template=plain") from None
    except BadConversation:
        raise
    except Exception as err:  # noqa: BLE001 - the template's own checks (raise_exception) and jinja's errors
        raise BadConversation(f"the chat template refused it ({type(err).__name__}: {first_line(err)})") from None
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [0] * len(encoded["input_ids"])
    span = 0
    for i, (start, end) in enumerate(encoded["offset_mapping"]):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:  # the token overlaps the assistant's text
            mask[i] = 1
    return list(encoded["input_ids"]), mask


def _assistant_spans(tok, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans of the assistant's turns, by incremental rendering."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        through = tok.apply_chat_template(messages[: k + 1], tokenize=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise TemplateNotIncremental(
                "the tokenizer's chat template renders the start of a conversation differently from the whole "
                "(the assistant's turns cannot be found): add {% generation %} tags around the assistant's "
                "content in the template, or set data.chat_template=plain")
        spans.append((len(before), len(through)))
    return text, spans


@contextlib.contextmanager
def _cpu_time_limit(seconds: float) -> Iterator[None]:
    """Raise _OutOfTime in the code inside once this process has spent `seconds` of CPU time in it (an ITIMER_VIRTUAL
    timer): Python code, a template's included, is stopped between two bytecodes. Signals reach the main thread
    only, where preparation renders (in its worker processes, or in the calling process); in another thread, or
    without timers, the code runs unbounded."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise _OutOfTime

    previous = signal.signal(signal.SIGVTALRM, expire)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)
