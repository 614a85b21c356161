"""Loss-mask golden tests: the trained tokens are exactly the assistant replies (plus the
template's end-of-turn marker), for ChatML (SmolLM2's own), Llama-3 and Qwen-style templates."""

import copy
from collections import Counter

import pytest

from data.chat import DataError, check_template, to_messages, tokenize_chat

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
CHAT = [
    {"role": "system", "content": "You are terse. SECRET-SYSTEM"},
    {"role": "user", "content": "Hi there USER-ONE"},
    {"role": "assistant", "content": "Hello, how can I help?"},
    {"role": "user", "content": "What is 2+2? USER-TWO"},
    {"role": "assistant", "content": "It is 4."},
]


def trained_runs(tok, ex):
    """Decoded text of each maximal run of trained tokens."""
    runs, cur = [], []
    for i, m in zip(ex.input_ids, ex.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


@pytest.fixture
def tok(smollm2_tokenizer):
    return copy.deepcopy(smollm2_tokenizer)


@pytest.mark.parametrize(
    "template,end",
    [(None, "<|im_end|>"), (LLAMA3, "<|eot_id|>"), (QWEN, "<|im_end|>")],
    ids=["chatml-smollm2", "llama3", "qwen"],
)
def test_golden_multi_turn(tok, template, end):
    if template:
        tok.chat_template = template
    if template is LLAMA3:  # as in the real Llama-3 tokenizer, its markers are single special tokens
        tok.add_special_tokens(
            {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
        )
    ex = tokenize_chat(tok, CHAT, max_len=4096)
    assert trained_runs(tok, ex) == ["Hello, how can I help?" + end, "It is 4." + end]
    # tokens are exactly what the template renders, so training sees what serving sees
    assert ex.input_ids == tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    untrained = tok.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if not m])
    for s in ("SECRET-SYSTEM", "USER-ONE", "USER-TWO"):
        assert s in untrained


def test_sharegpt_and_messages_records_agree(tok):
    sg = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    ms = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert to_messages(sg) == to_messages(ms)
    with pytest.raises(DataError, match="unknown role"):
        to_messages({"conversations": [{"from": "robot", "value": "x"}]})
    with pytest.raises(DataError, match="neither"):
        to_messages({"text": "x"})


def test_skips_are_counted(tok):
    stats = Counter()
    assert tokenize_chat(tok, [{"role": "user", "content": "only a question"}], 512, stats) is None
    empty = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]
    assert tokenize_chat(tok, empty, 512, stats) is None
    # an empty turn among real ones keeps the conversation and trains only the real turn
    mixed = CHAT[:2] + [{"role": "assistant", "content": ""}] + CHAT[3:]
    ex = tokenize_chat(tok, mixed, 4096, stats)
    assert trained_runs(tok, ex) == ["It is 4.<|im_end|>"]
    assert stats == Counter(skipped_no_assistant=1, skipped_empty_assistant=1, empty_assistant_turns=2, kept=1)


def test_truncation_to_max_len(tok):
    stats = Counter()
    full = tokenize_chat(tok, CHAT, 4096)
    ex = tokenize_chat(tok, CHAT, len(full.input_ids) - 3, stats)
    assert ex.input_ids == full.input_ids[:-3] and ex.loss_mask == full.loss_mask[:-3]
    assert stats["truncated"] == 1
    # cut before any assistant token: nothing left to train, counted
    assert tokenize_chat(tok, CHAT, 10, stats) is None
    assert stats["skipped_nothing_trainable_within_max_len"] == 1


def test_no_chat_template_is_a_clear_error(tok):
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        check_template(tok)
