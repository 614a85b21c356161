"""Prompts written by the target itself (Magpie-style self-instruct): `capture.py prompts`.

The shipped draft accepts 83% of first tokens on held-out chats of its own data but 46-56% on the
benchmarks (README, "What limits it"): the packaged ShareGPT prompts are too narrow. An
instruction-tuned target, given its chat template up to the start of a user turn and nothing else,
writes a user request from its own idea of what users ask (Magpie, Xu et al. 2024); answered by
the same target (`capture.py regenerate`), that is data from exactly the distribution the draft
will serve, as varied as the target's sampling.

Here: the pre-query prefix of a chat template, and the filters a written prompt passes before it
is kept (each drop is counted by its reason). Benchmark prompts never enter: a prompt sharing a
run of 8 words with any MT-Bench, HumanEval or GSM8K prompt (or equal to one) is dropped.
"""

import re

from data.benchmarks import DATASETS, load_prompts
from data.chat import DataError
from data.loops import loop_cut

MARK = "\x00QUERY\x00"  # stands for the user's text while the template is rendered
NGRAM = 8  # words in a run shared with a benchmark prompt that drop a written prompt


def query_prefix(tokenizer, system: str | None = None) -> list[int]:
    """Token ids of the chat template up to where a user turn's text starts (system: an explicit
    system turn; None = what the template writes without one, e.g. SmolLM2's default system prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the tokenizer has no chat template: self-instruct prompts start from one")
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": MARK}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    if text.count(MARK) != 1:
        raise DataError("the chat template does not write the user's text verbatim once: cannot find where it starts")
    return tokenizer(text[: text.index(MARK)], add_special_tokens=False)["input_ids"]


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def normalized(text: str) -> str:
    return " ".join(words(text))


class BenchmarkGuard:
    """Which written prompts overlap a benchmark prompt: a shared run of NGRAM words, or (for short
    ones) the same words."""

    def __init__(self, prompts: list[str]):
        self.grams, self.whole = set(), set()
        for p in prompts:
            w = words(p)
            self.whole.add(" ".join(w))
            self.grams.update(tuple(w[i : i + NGRAM]) for i in range(len(w) - NGRAM + 1))

    def hits(self, text: str) -> bool:
        w = words(text)
        if " ".join(w) in self.whole:
            return True
        return any(tuple(w[i : i + NGRAM]) in self.grams for i in range(len(w) - NGRAM + 1))


def benchmark_prompts() -> list[str]:
    """Every user turn of the packaged benchmarks the drafts are evaluated on (data/benchmarks.py)."""
    return [t for name in DATASETS for conv in load_prompts(name, 0) for t in conv]


def drop_reason(
    text: str, ids: list[int], hit_cap: bool, special: list[str], seen: set[str], guard: BenchmarkGuard, min_words: int
) -> str | None:
    """Why a written prompt is not kept (None: kept). text: its decoded text (special tokens left
    in), ids: its token ids, hit_cap: it ran to the token cap without ending its turn, seen: the
    normalized prompts kept so far (this one is added when kept)."""
    if hit_cap:
        return "no_end_of_turn"
    if any(s in text for s in special):
        return "template_tokens"  # it wrote a turn marker (e.g. answered itself)
    if len(words(text)) < min_words:
        return "too_short"
    if loop_cut(ids) is not None:
        return "loop"
    if guard.hits(text):
        return "benchmark_overlap"
    key = normalized(text)
    if key in seen:
        return "duplicate"
    seen.add(key)
    return None
