"""Chat records -> token ids + assistant-only loss mask, with the target's own chat template.

The mask is found by rendering, not by regexes per template: for every assistant turn i,
  prefix_i = template(messages[:i], add_generation_prompt=True)
  upto_i   = template(messages[:i+1])
and the characters upto_i[len(prefix_i):] (content plus the template's end-of-turn marker,
trailing whitespace dropped) are what the assistant produced. Token t is trained iff its first
character falls in such a span. This is right for multi-turn chats with any template that
renders a conversation as a prefix of its continuation (ChatML, Llama-3, Qwen2.5, ...); a
template that is not (e.g. one that rewrites earlier turns) is reported as an error.

loss_mask[t] = 1 iff token t is assistant output (a token the target is trained to say).
"""

from collections import Counter
from dataclasses import dataclass

ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}


class DataError(ValueError):
    """Bad input data, with enough context (file, line, record) to find it."""


def to_messages(record: dict) -> list[dict]:
    """ShareGPT `conversations: [{from, value}]` or `messages: [{role, content}]` -> messages. A content may
    be OpenAI-style parts, [{"type": "text", "text": ...}, ...]: the text parts are joined (see _text)."""
    if not isinstance(record, dict):
        raise DataError(f"record is a JSON {type(record).__name__}, not an object with 'messages' or 'conversations'")
    if record.get("messages") is not None:
        key, rkey, ckey = "messages", "role", "content"
    elif record.get("conversations") is not None:
        key, rkey, ckey = "conversations", "from", "value"
    else:
        raise DataError(f"record has neither 'messages' nor 'conversations' (keys: {sorted(record)})")
    turns = record[key]
    if not isinstance(turns, list):
        raise DataError(f"'{key}' is a JSON {type(turns).__name__}, not a list of turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{key}[{i}] is a JSON {type(turn).__name__}, not an object with '{rkey}' and '{ckey}'")
        role = ROLES.get(str(turn.get(rkey, "")).lower())
        if role is None:
            raise DataError(f"unknown role {turn.get(rkey)!r} (known: {sorted(ROLES)})")
        messages.append({"role": role, "content": _text(turn.get(ckey), f"{key}[{i}].{ckey}")})
    return messages


def _text(content, where: str) -> str:
    """A turn's content as text: a string, a number, None (""), or chat-API content parts whose text parts are
    joined with newlines as vLLM's chat endpoint joins them; a part of another type (an image, audio) has no text
    a text draft could train on, so it is refused rather than stringified into the data."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (int, float)) and not isinstance(content, bool):
        return str(content)
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise DataError(
                    f"{where}[{j}]: a content part of type {kind!r}; only text parts "
                    '({"type": "text", "text": ...}) are read'
                )
        return "\n".join(texts)
    raise DataError(f"{where} is a JSON {type(content).__name__}, not text or a list of text parts")


def check_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: "
            "training needs one to find the assistant tokens (set tokenizer.chat_template or use an instruct model)"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("a fast tokenizer (with offset mapping) is needed to place the loss mask")


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]


def tokenize_chat(tokenizer, messages: list[dict], max_len: int, stats: Counter | None = None) -> Example | None:
    """Render and tokenize one conversation. Returns None (and counts why) when nothing is
    trainable: no assistant turn, only empty assistant turns, or all of it beyond max_len."""
    stats = Counter() if stats is None else stats
    # a conversation cannot open with the assistant: there is no prompt to condition on
    while messages and messages[0]["role"] == "assistant":
        messages = messages[1:]
        stats["leading_assistant_dropped"] += 1
    if not any(m["role"] == "assistant" for m in messages):
        stats["skipped_no_assistant"] += 1
        return None

    def render(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if not m["content"].strip():
            stats["empty_assistant_turns"] += 1  # kept in context, not trained
            continue
        prefix, upto = render(messages[:i], gen=True), render(messages[: i + 1])
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise DataError(
                "the chat template does not render a conversation as a prefix of its continuation, "
                f"so assistant turns cannot be located (turn {i})"
            )
        end = len(upto.rstrip())
        if end > len(prefix):
            spans.append((len(prefix), end))
    if not spans:
        stats["skipped_empty_assistant"] += 1
        return None

    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask, s = [], 0
    for start, _ in offsets:
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        mask.append(int(s < len(spans) and spans[s][0] <= start))
    if len(ids) > max_len:
        stats["truncated"] += 1
        ids, mask = ids[:max_len], mask[:max_len]
    # the draft predicts token t+2 from position t: fewer than 3 tokens or no trained token
    # at index >= 2 leaves nothing to learn
    if sum(mask[2:]) == 0:
        stats["skipped_nothing_trainable_within_max_len"] += 1
        return None
    stats["kept"] += 1
    return Example(ids, mask)


def render(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt ids the target continues: the chat template with the generation prompt (an assistant turn
    opened), no special tokens added twice."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
