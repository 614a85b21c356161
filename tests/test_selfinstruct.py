"""capture.py prompts (data/selfinstruct.py): the target writes user prompts from its chat template's
pre-query prefix; filters, benchmark exclusion, resume after a crash equal to one uninterrupted run."""

import json
import shutil

import pytest

from capture import PromptsConfig, RegenConfig, regenerate, write_prompts
from data.benchmarks import load_prompts
from data.selfinstruct import BenchmarkGuard, benchmark_prompts, drop_reason, query_prefix


def test_query_prefix(smollm2_tokenizer):
    text = smollm2_tokenizer.decode(query_prefix(smollm2_tokenizer))
    assert text.endswith("<|im_start|>user\n") and "You are a helpful AI assistant named SmolLM" in text
    text = smollm2_tokenizer.decode(query_prefix(smollm2_tokenizer, "Answer in French."))
    assert text == "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\n"

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        query_prefix(NoTemplate())


def test_drop_reasons():
    guard = BenchmarkGuard(["Janet has three ducks that lay sixteen eggs per day and she eats two", "Hi there"])
    special = ["<|im_end|>", "<|im_start|>"]
    seen: set = set()

    def why(text, ids=None, hit=False, min_words=3):
        return drop_reason(text, ids or list(range(len(text.split()))), hit, special, seen, guard, min_words)

    assert why("What is the capital of France?") is None
    assert why("what is the CAPITAL of france") == "duplicate"  # same words
    assert why("Tell me a story about a dragon", hit=True) == "no_end_of_turn"
    assert why("Write a poem<|im_end|>\n<|im_start|>assistant\nRoses are red") == "template_tokens"
    assert why("Hello", min_words=3) == "too_short" and why("Hi there!", min_words=1) == "benchmark_overlap"
    assert why("So: janet has three ducks that lay sixteen eggs per day. How many?") == "benchmark_overlap"
    assert why("Janet has three ducks that lay eggs. How many per week?") is None  # no 8-word run shared
    assert why("Repeat after me please now", ids=[5, 6, 7] * 40) == "loop"


def test_benchmark_prompts_are_caught():
    prompts = benchmark_prompts()
    assert len(prompts) > 1000  # MT-Bench turns, HumanEval and GSM8K
    guard = BenchmarkGuard(prompts)
    for name in ("mtbench", "humaneval", "gsm8k"):
        p = load_prompts(name, 1)[0][0]
        assert guard.hits(p) and guard.hits("Please help: " + p.upper())
    assert not guard.hits("Can you recommend mental health support online?")


@pytest.fixture(scope="module")
def eager_target(tiny_run_inputs, tmp_path_factory):
    """The tiny random target with a fifth of its vocabulary as end-of-turn ids, so that its random
    prompts end within a few tokens (and some are kept)."""
    target, _ = tiny_run_inputs
    d = tmp_path_factory.mktemp("eager") / "target"
    shutil.copytree(target, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(1000, 11000))}))
    return d


def _cfg(target, out, **kw):
    base = dict(target=str(target), out=str(out), num_prompts=10**6, max_new_tokens=5, batch_size=6, min_words=1)
    return PromptsConfig(**{**base, **kw})


def _lines(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("engine", ["hf", "slots"])
def test_prompts_resume_after_a_crash_equals_one_run(tmp_path, eager_target, engine):
    one = write_prompts(_cfg(eager_target, tmp_path / "one.jsonl", max_batches=3, engine=engine))
    c = one["counts"]
    assert c["batches"] == 3 and c["kept"] + c["dropped"] == 18 and c["kept"] > 0 and c["dropped"] > 0
    kept, dropped = _lines(tmp_path / "one.jsonl"), _lines(tmp_path / "one.dropped.jsonl")
    assert all(
        r["messages"][0]["role"] == "user" and r["messages"][1] == {"role": "assistant", "content": ""} for r in kept
    )
    assert {d["reason"] for d in dropped} <= {"no_end_of_turn", "template_tokens", "too_short", "loop", "duplicate"}
    assert len({r["id"] for r in kept + dropped}) == 18

    out = tmp_path / "two.jsonl"
    write_prompts(_cfg(eager_target, out, max_batches=2, engine=engine))
    # a crash inside batch 1's writes: its dropped lines are there, its kept ones only in part
    lines = out.read_text().splitlines(keepends=True)
    n1 = sum(json.loads(x)["batch"] == 1 for x in lines)
    if n1:
        out.write_text("".join(lines[:-1]) + lines[-1][:7])  # and a partial last line
    else:  # batch 1 kept nothing: lose one of its dropped lines instead
        d = out.with_name("two.dropped.jsonl")
        d.write_text("".join(d.read_text().splitlines(keepends=True)[:-1]))
    write_prompts(_cfg(eager_target, out, max_batches=3, engine=engine))
    assert _lines(out) == kept and _lines(tmp_path / "two.dropped.jsonl") == dropped
    prov = json.loads((tmp_path / "two.provenance.json").read_text())
    assert prov["counts"] == c and len(prov["runs"]) == 2 and prov["runs"][-1]["status"] == "complete"

    with pytest.raises(SystemExit, match="other settings"):
        write_prompts(_cfg(eager_target, out, max_batches=4, engine=engine, temperature=0.5))


def test_written_prompts_are_answered_by_regenerate(tmp_path, eager_target):
    write_prompts(_cfg(eager_target, tmp_path / "p.jsonl", max_batches=2))
    kept = _lines(tmp_path / "p.jsonl")
    doc = regenerate(
        RegenConfig(
            target=str(eager_target), data=str(tmp_path / "p.jsonl"), out=str(tmp_path / "a.jsonl"), max_new_tokens=4
        )
    )
    assert doc["counts"]["written"] + doc["counts"]["dropped"] == len(kept) > 0
    for r in _lines(tmp_path / "a.jsonl"):
        assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant"] or [
            m["role"] for m in r["messages"]
        ] == ["user", "assistant"]


def test_user_prefix_steers_each_prompt(tmp_path, eager_target):
    """--user-prefix: prompt j of batch b starts with prefix (b * batch_size + j) mod n and the target
    continues it; greedy, the slots engine writes what transformers' generate writes after the same
    start; a resume with other prefixes is refused."""
    ups = ("Write a Python function that", "A farmer has")
    texts = {}
    for engine in ("hf", "slots"):
        out = tmp_path / f"{engine}.jsonl"
        write_prompts(
            _cfg(eager_target, out, max_batches=2, batch_size=3, engine=engine, temperature=0.0, user_prefix=ups)
        )
        rows = _lines(out) + _lines(out.with_name(f"{engine}.dropped.jsonl"))
        for r in rows:
            text = r["messages"][0]["content"] if "messages" in r else r["text"]
            j = int(r["id"].rsplit("-", 1)[1])
            assert text.startswith(ups[(r["batch"] * 3 + j) % 2])
        texts[engine] = sorted((r["id"], r.get("reason"), r.get("text") or r["messages"][0]["content"]) for r in rows)
        assert json.loads(out.with_name(f"{engine}.provenance.json").read_text())["settings"]["user_prefix"] == list(
            ups
        )
    assert texts["hf"] == texts["slots"] and len(texts["hf"]) == 6
    with pytest.raises(SystemExit, match="other settings"):
        write_prompts(
            _cfg(eager_target, tmp_path / "hf.jsonl", max_batches=3, batch_size=3, engine="hf", temperature=0.0)
        )
