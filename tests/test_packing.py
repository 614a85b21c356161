"""Sequence packing (data/packing.py) keeps documents apart everywhere: the layout, the HF and
compiled targets' attention and rope, and EAGLE-3's TTT attention, loss masks and rows. Packed
== one conversation per row (loss, accuracies, counts, gradients) on every CPU attention path
and objective, and perturbing one document changes nothing for its row-mates. train.py: packed
== unpacked on the same conversations, families that cannot pack refuse it, run.json records
the packing efficiency, metrics.jsonl the throughput."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from core import runlog
from core.feeding import Batcher, packing
from core.train_config import ConfigError, TrainConfig, packing_blocker
from data.chat import DataError, Example
from data.datasets import collate
from data.packing import TokenBatches, bucket, first_fit_decreasing, pack, pad_batch_rows, pad_rows, plan_rows
from data.vocab import build_vocab_mapping
from models.eagle3 import FAMILY as EAGLE3
from models.eagle3 import Eagle3Config, Eagle3Draft, local_counts, select_rows
from models.families import FAMILIES
from models.fast_target import FastTarget
from models.peagle import FAMILY as PEAGLE
from models.peagle import PEagleConfig, PEagleDraft, peagle_counts, peagle_host
from models.target import Target
from tests.test_fast_target import hf_model
from tests.test_train_e2e import final_params, run_train, train_rows
from tests.tiny import random_examples

CPU = torch.device("cpu")

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


# ---------------------------------------------------------------- layout
def test_pack_layout():
    ex = random_examples(23, vocab=50, min_len=1, max_len=40, seed=1)
    b = pack(ex, row_len=48)
    again = pack(ex, row_len=48)
    assert all(torch.equal(b[k], again[k]) for k in b)  # a pure function of the batch
    R, T = b["input_ids"].shape
    assert len(ex) > R and T <= 48
    lengths = [len(e.input_ids) for e in ex]
    assert len({r for r, _ in first_fit_decreasing(lengths, 48)}) == R
    for i, e in enumerate(ex):
        r, s = b["where"][i].tolist()
        n = len(e.input_ids)
        assert (
            b["input_ids"][r, s : s + n].tolist() == e.input_ids
            and b["loss_mask"][r, s : s + n].tolist() == e.loss_mask
        )
        assert b["position_ids"][r, s : s + n].tolist() == list(range(n))
        assert len(set(b["doc_ids"][r, s : s + n].tolist())) == 1
    for r in range(R):
        d, n = b["doc_ids"][r], int(b["attention_mask"][r].sum())
        assert (d[:n] >= 0).all() and (d[n:] == -1).all() and (d[1:n] >= d[: n - 1]).all()  # labels grow along the row
        assert b["loss_mask"][r, n:].sum() == 0
    assert int(b["attention_mask"].sum()) == sum(lengths)
    with pytest.raises(ValueError, match="more than the row length 48"):
        pack([Example([1] * 49, [1] * 49)], row_len=48)


def test_pad_rows_extends_the_padding_document():
    b = pad_rows(pack([Example([1, 2, 3], [0, 1, 1]), Example([4, 5], [0, 1])], row_len=4), 7)
    assert b["doc_ids"].tolist() == [[0, 0, 0, -1, -1, -1, -1], [0, 0, -1, -1, -1, -1, -1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4]]
    assert b["input_ids"][:, 3:].abs().sum() == 0


# ---------------------------------------------------------------- targets
def _docs(lengths, vocab, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [Example(torch.randint(0, vocab, (n,), generator=g).tolist(), [1] * n) for n in lengths]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_target_packed_rows_match_separate_sequences(impl):
    """transformers (5.x) honours the 4D document mask and per-document positions with sdpa and eager."""
    hf = hf_model("qwen3", seed=1)
    hf.config._attn_implementation = impl
    target = Target(hf, [1, 4])
    ex = _docs([23, 40, 7, 31, 12, 5], hf.config.vocab_size)
    b = pack(ex, row_len=48)
    assert b["input_ids"].shape[0] < len(ex)
    f = target(b["input_ids"], doc_ids=b["doc_ids"], position_ids=b["position_ids"])
    for i, e in enumerate(ex):
        r, s = b["where"][i].tolist()
        ref = target(torch.tensor([e.input_ids]))
        n = len(e.input_ids)
        torch.testing.assert_close(f.aux_hidden[r, s : s + n], ref.aux_hidden[0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(f.final_hidden[r, s : s + n], ref.final_hidden[0], rtol=1e-5, atol=1e-4)
    # a row-mate changed: nothing else in the row moves
    r0, s0 = b["where"][1].tolist()
    ids = b["input_ids"].clone()
    ids[r0, s0 : s0 + 40] = (ids[r0, s0 : s0 + 40] + 1) % hf.config.vocab_size
    f2 = target(ids, doc_ids=b["doc_ids"], position_ids=b["position_ids"])
    other = (b["doc_ids"] != b["doc_ids"][r0, s0]) | (torch.arange(ids.shape[0])[:, None] != r0)
    other &= b["attention_mask"].bool()
    assert torch.equal(f2.aux_hidden[other], f.aux_hidden[other]) and not torch.equal(f2.aux_hidden, f.aux_hidden)


def test_hf_target_refuses_packing_with_other_attention():
    hf = hf_model("llama", seed=1)
    hf.config._attn_implementation = "flash_attention_2"
    b = pack(_docs([5, 6], hf.config.vocab_size), row_len=16)
    with pytest.raises(ValueError, match="packed rows need the target's attention"):
        Target(hf, [1])(b["input_ids"], doc_ids=b["doc_ids"], position_ids=b["position_ids"])


def test_compiled_target_takes_packed_batches():
    hf = hf_model("llama", seed=2)
    ref_t, fast = Target(hf, [0, 3]), FastTarget.from_hf_model(hf, [0, 3])
    b = pack(_docs([9, 30, 17, 4], hf.config.vocab_size, seed=5), row_len=40)
    f, ref = (
        fast(b["input_ids"], doc_ids=b["doc_ids"], position_ids=b["position_ids"]),
        ref_t(b["input_ids"], doc_ids=b["doc_ids"], position_ids=b["position_ids"]),
    )
    real = b["attention_mask"].bool()
    tol = dict(rtol=1e-5, atol=1e-5 * max(1.0, ref.final_hidden.abs().max().item()))
    torch.testing.assert_close(f.aux_hidden[real], ref.aux_hidden[real], **tol)
    torch.testing.assert_close(f.final_hidden[real], ref.final_hidden[real], **tol)


# ---------------------------------------------------------------- EAGLE-3 draft
K = 3


def _draft_setup(fc_norm=False, norm_output=False, seed=0):
    hf = hf_model("llama", seed=seed)
    target = Target(hf, [1, 3, 4])
    c = Eagle3Config.from_target(hf.config, 64, target.aux_layers, fc_norm=fc_norm, norm_output=norm_output)
    torch.manual_seed(seed)
    draft = Eagle3Draft(c)
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = build_vocab_mapping(torch.rand(hf.config.vocab_size, generator=g), 64)
    draft.d2t.copy_(d2t), draft.t2d.copy_(t2d)
    # documents with assistant spans up to their last token, so cross-boundary rows would be trained if not masked
    ex = random_examples(7, hf.config.vocab_size, min_len=6, max_len=30, seed=seed + 1)
    ex = [Example(e.input_ids, e.loss_mask[:-1] + [1]) for e in ex]
    return target, draft, ex


def _features(target, b):
    """The target's features of a batch, packed (documents apart) or one conversation per row."""
    if "doc_ids" in b:
        return target(b["input_ids"], doc_ids=b["doc_ids"], position_ids=b["position_ids"])
    return target(b["input_ids"], b["attention_mask"])


def _step(target, draft, b, attention, objective, host_rows):
    feats = _features(target, b)
    batch = EAGLE3.make_batch(feats, b, target, draft)
    counts = local_counts(batch, draft.t2d, K)
    rows = None
    if host_rows:  # chosen on the host, then moved, as train.py's prefetcher does
        doc = b["doc_ids"].cpu() if "doc_ids" in b else None
        rows = select_rows(b["loss_mask"].cpu(), K, doc_ids_BT=doc).to(b["loss_mask"].device)
    draft.zero_grad()
    loss, stats = draft(batch, K, counts, attention=attention, rows=rows, objective=objective)
    loss.backward()
    return loss.detach(), stats, counts, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "attention,objective,host_rows,v31",
    [
        ("eager", "kl", False, False),
        ("lse", "kl", False, False),
        ("lse", "kl", True, False),
        ("lse", "lk-alpha", False, False),
        ("eager", "lk-lambda", True, False),
        ("lse", "kl", False, True),
    ],
)
def test_eagle3_packed_equals_one_conversation_per_row(attention, objective, host_rows, v31):
    """Same conversations packed and one per row: same loss, per-step sums, accuracies, counts and gradients
    (CPU paths eager / lse, device-side and host-chosen rows, the KL and LK objectives, EAGLE-3.1 options)."""
    target, draft, ex = _draft_setup(fc_norm=v31, norm_output=v31)
    packed = pack(ex, row_len=64)
    assert packed["input_ids"].shape[0] < len(ex)
    a = _step(target, draft, collate(ex), attention, objective, host_rows)
    b = _step(target, draft, packed, attention, objective, host_rows)
    assert a[2][:, 0].min() > 0 and torch.equal(a[2], b[2])  # counts: every step trains rows, the same ones
    torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b[1]["loss_sum"], a[1]["loss_sum"], rtol=1e-5, atol=1e-5)
    assert torch.equal(b[1]["correct"], a[1]["correct"])
    assert a[3].keys() == b[3].keys() and len(a[3]) > 5
    for n in a[3]:
        torch.testing.assert_close(b[3][n], a[3][n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ["flex", "flex_buf", "eager"])
def test_eagle3_packed_equals_one_conversation_per_row_cuda(attention):
    """The GPU paths (flex with the document block mask, host-chosen rows) train packed rows as one per row (fp32)."""
    target, draft, ex = _draft_setup()
    target, draft = target.cuda(), draft.cuda()
    on_gpu = lambda b: {k: v.cuda() for k, v in b.items()}  # noqa: E731
    a = _step(target, draft, on_gpu(collate(ex)), attention, "kl", True)
    b = _step(target, draft, on_gpu(pack(ex, row_len=64)), attention, "kl", True)
    assert a[2][:, 0].min() > 0 and torch.equal(a[2], b[2])
    torch.testing.assert_close(b[0], a[0], rtol=1e-4, atol=1e-5)
    assert torch.equal(b[1]["correct"], a[1]["correct"])
    for n in a[3]:
        torch.testing.assert_close(b[3][n], a[3][n], rtol=1e-3, atol=1e-5, msg=n)


def test_eagle3_row_mates_unaffected():
    """Perturbing one document's tokens leaves its row-mate's loss and gradients as they were: only the
    row-mate is trained (the others' loss masks zeroed), the perturbed document shares its row."""
    target, draft, ex = _draft_setup(seed=4)
    b = pack(ex, row_len=64)
    r, s = b["where"][0].tolist()
    mate = next(i for i in range(1, len(ex)) if b["where"][i, 0] == r)
    ms, mn = b["where"][mate, 1].item(), len(ex[mate].input_ids)
    keep = torch.zeros_like(b["loss_mask"])
    keep[r, ms : ms + mn] = 1
    b["loss_mask"] = b["loss_mask"] * keep
    ref = _step(target, draft, b, "lse", "kl", False)
    n0 = len(ex[0].input_ids)
    b["input_ids"] = b["input_ids"].clone()
    b["input_ids"][r, s : s + n0] = (b["input_ids"][r, s : s + n0] + 7) % target.config.vocab_size
    got = _step(target, draft, b, "lse", "kl", False)
    assert ref[2][0, 0] > 0
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7)
    for n in ref[3]:
        torch.testing.assert_close(got[3][n], ref[3][n], rtol=1e-5, atol=1e-7, msg=n)


# ---------------------------------------------------------------- P-EAGLE
def _peagle_step(target, draft, b, attention="dense", grad=True):
    b = peagle_host(
        dict(b), draft.K, lambda i: torch.Generator().manual_seed(100 + i)
    )  # per example, as train.py seeds them
    feats = _features(target, b)
    batch = PEAGLE.make_batch(feats, b, target, draft)
    counts = peagle_counts(batch, draft.K)
    draft.zero_grad()
    with torch.set_grad_enabled(grad):
        loss, stats = draft(batch, counts, attention=attention)
    if grad:
        loss.backward()
    return loss.detach(), stats, counts, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def test_peagle_packed_equals_one_conversation_per_row():
    """P-EAGLE: the same rollouts drawn per conversation, moved into packed rows: same loss, sums, accuracies,
    counts and gradients (dense path; flex forward too), and row-mates' elements never see each other."""
    target, _, ex = _draft_setup(seed=5)
    c = PEagleConfig.from_target(target.config, 64, target.aux_layers, mask_token_id=7, depths=3)
    torch.manual_seed(0)
    draft = PEagleDraft(c)
    g = torch.Generator().manual_seed(0)
    d2t, t2d = build_vocab_mapping(torch.rand(target.config.vocab_size, generator=g), 64)
    draft.d2t.copy_(d2t), draft.t2d.copy_(t2d)
    packed = pack(ex, row_len=64)
    assert packed["input_ids"].shape[0] < len(ex)
    a, b = _peagle_step(target, draft, collate(ex)), _peagle_step(target, draft, packed)
    assert (a[2][:, 0] > 0).all() and torch.equal(a[2], b[2])  # every depth trains, the same elements
    torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b[1]["loss_sum"], a[1]["loss_sum"], rtol=1e-5, atol=1e-5)
    assert torch.equal(b[1]["correct"], a[1]["correct"])
    for n in a[3]:
        torch.testing.assert_close(b[3][n], a[3][n], rtol=1e-4, atol=1e-6, msg=n)
    fa, fb = _peagle_step(target, draft, collate(ex), "flex", False), _peagle_step(target, draft, packed, "flex", False)
    torch.testing.assert_close(fb[0], fa[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fb[0], b[0], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------ every family through its strategy (what train.py runs)
def _strategy_step(name, cfg, target, draft, b, device=CPU, module=None):
    """module: what runs the step (train.py's draft_step, torch.compile(draft) under --compile); default the draft."""
    s = FAMILIES[name]
    b = s.host(dict(b), cfg, device, 3)  # draws seeded by (seed, key, example index), as in train.py
    b = {k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()}
    feats = _features(target, b)
    batch = s.make_batch(feats, b, target, draft)
    counts = s.counts(batch, draft, cfg)
    draft.zero_grad()
    loss, stats = s.step(draft if module is None else module, batch, counts, cfg, b, 0.6)
    loss.backward()
    return loss.detach(), stats, counts, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


OBJECTIVES = [
    ("eagle3", "kl"),
    ("peagle", "kl"),
    ("dflash", "ce"),
    ("dflash", "dpace"),
    ("domino", "ce"),
    ("dspark", "ce-l1-conf"),
]


@pytest.mark.parametrize("padding_rows", [0, 2])
@pytest.mark.parametrize("strategy,objective", OBJECTIVES)
def test_every_family_packed_equals_one_conversation_per_row(strategy, objective, padding_rows):
    """Each family that packs, through its strategy's host / make_batch / counts / step: the same conversations
    packed and one per row give the same loss, per-position sums, accuracies, counts and gradients (CPU:
    eagle3 on its lse path, the others dense); also with rows of padding added (what a GPU run does)."""
    attention = "lse" if strategy == "eagle3" else "eager"
    _family_packed_vs_rows(strategy, objective, attention, torch.device("cpu"), 1e-4, padding_rows=padding_rows)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy,objective", OBJECTIVES)
def test_every_family_packed_equals_one_conversation_per_row_cuda(strategy, objective):
    """The same on the GPU through flex (document block masks; EAGLE-3's host-chosen rows), fp32, with
    two rows of padding added, as train.py adds them there (pad_batch_rows)."""
    _family_packed_vs_rows(strategy, objective, "flex", torch.device("cuda"), 1e-3, padding_rows=2)


@pytest.mark.parametrize("strategy,objective", [("eagle3", "kl"), ("dflash", "ce")])
def test_compiled_packed_step_equals_eager_rows(strategy, objective):
    """train.py --compile --pack: the step compiled as a unit builds its document masks in the graph and gives
    the eager one-conversation-per-row numbers (CPU inductor; eagle3 on lse, dflash dense)."""
    torch._dynamo.reset()
    _family_packed_vs_rows(
        strategy, objective, "lse" if strategy == "eagle3" else "eager", torch.device("cpu"), 1e-4, True
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy,objective", OBJECTIVES)
def test_compiled_packed_step_equals_eager_rows_cuda(strategy, objective):
    """The same through compiled flex (the document block masks built inside the compiled step), fp32."""
    torch._dynamo.reset()
    _family_packed_vs_rows(strategy, objective, "flex", torch.device("cuda"), 1e-3, True)


def _family_packed_vs_rows(strategy, objective, attention, device, rtol, compiled=False, padding_rows=0):
    cfg = TrainConfig(
        strategy=strategy,
        objective=objective,
        attention=attention,
        loss="torch",
        ttt_length=3,
        num_anchors=3,
        draft_vocab_size=64,
        loss_decay=2.0 if strategy == "dflash" else 0.0,
    )
    target, _, ex = _draft_setup(seed=6)
    torch.manual_seed(1)
    tok = SimpleNamespace(all_special_ids=[], added_tokens_decoder={})
    draft = FAMILIES[strategy].build(cfg, target, torch.rand(target.config.vocab_size), tok)
    with torch.no_grad():  # away from the initial weights (norms 1, zero biases)
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    packed = pack(ex, row_len=64)
    assert FAMILIES[strategy].packs and packed["input_ids"].shape[0] < len(ex)
    R = packed["input_ids"].shape[0]
    packed = pad_batch_rows(packed, R + padding_rows)  # all-padding rows change nothing
    assert packed["input_ids"].shape[0] == R + padding_rows
    target, draft = target.to(device), draft.to(device)
    a = _strategy_step(strategy, cfg, target, draft, collate(ex), device)
    b = _strategy_step(strategy, cfg, target, draft, packed, device, torch.compile(draft) if compiled else None)
    assert (a[2][:, 0] > 0).all() and torch.equal(a[2], b[2])  # every drafted position trains, the same rows
    torch.testing.assert_close(b[0], a[0], rtol=rtol / 10, atol=1e-6)
    torch.testing.assert_close(b[1]["loss_sum"], a[1]["loss_sum"], rtol=rtol / 10, atol=1e-5)
    assert torch.equal(b[1]["correct"], a[1]["correct"])
    assert a[3].keys() == b[3].keys() and len(a[3]) > 5
    for n in a[3]:
        torch.testing.assert_close(b[3][n], a[3][n], rtol=rtol, atol=1e-6 if device.type == "cpu" else 1e-5, msg=n)


# ---------------------------------------------------------------- train.py
PACKS = ["--max-len", "256"]  # the tiny chats are 76..218 tokens: rows of 256 hold two of the short ones


@pytest.mark.parametrize(
    "strategy,backend", [("eagle3", "hf"), ("eagle3", "compiled"), ("peagle", "hf"), ("dflash", "hf")]
)
def test_train_packed_equals_unpacked(tmp_path, tiny_run_inputs, strategy, backend):
    target, data = tiny_run_inputs
    pad = (
        ["--pad-to-max-len", "--pack-row-multiple", "3"] if backend == "hf" and strategy == "eagle3" else []
    )  # padded packed rows (pad_rows) and rows of padding (pad_batch_rows) change nothing either
    common = ["--steps", "4", *PACKS, "--strategy", strategy, "--backend", backend]
    run_train(tmp_path / "packed", target, data, 1, [*common, "--pack", "on", *pad])
    run_train(tmp_path / "rows", target, data, 1, [*common, "--pack", "off"])
    p, u = train_rows(tmp_path / "packed"), train_rows(tmp_path / "rows")
    assert len(p) == len(u) == 4
    for a, b in zip(p, u):
        for k in ("loss", "loss_0", "loss_2", "acc_0", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)
    evals = [
        [r for r in map(json.loads, open(tmp_path / n / "metrics.jsonl")) if r["split"] == "eval"]
        for n in ("packed", "rows")
    ]
    assert len(evals[0]) == 2 and [r["loss_0"] for r in evals[0]] == pytest.approx(
        [r["loss_0"] for r in evals[1]], rel=1e-5
    )
    for k, v in final_params(tmp_path / "rows").items():
        torch.testing.assert_close(
            final_params(tmp_path / "packed")[k], v, rtol=1e-4, atol=1e-5, msg=k
        )  # as 2 ranks == 1 rank
    res = [json.loads((tmp_path / n / "run.json").read_text())["results"]["packing"] for n in ("packed", "rows")]
    assert res[0]["packed"] and not res[1]["packed"] and res[0]["real_tokens"] == res[1]["real_tokens"] > 0
    if not pad:
        assert 1 >= res[0]["efficiency"] > res[1]["efficiency"]  # fewer padded tokens
    assert res[1]["efficiency"] == pytest.approx(res[1]["real_tokens"] / res[1]["row_tokens"])
    # throughput: after the warm-up steps only, padded >= real
    assert "real_tokens_per_s" not in p[0] and all(r["row_tokens_per_s"] >= r["real_tokens_per_s"] > 0 for r in p[2:])
    assert "mfu" not in p[-1]  # no known peak on a CPU: no MFU rather than a made-up one


def test_eval_in_the_training_steps_rows(tmp_path, tiny_run_inputs):
    """A --batch-tokens run evaluates in its training step's rows (Batcher.eval_batches): every held-out
    conversation once, each batch padded to the step's row count where row counts are rounded (a GPU: one
    compiled shape for evaluation and training), and the held-out figures equal those of batches of
    conversations (packing and padding rows change nothing)."""
    cfg = TrainConfig(max_len=256, batch_tokens=768, ttt_length=3)
    ex = random_examples(23, 97, min_len=20, max_len=200, seed=3)
    tb = TokenBatches([len(e.input_ids) for e in ex], rows=3, row_len=256, seed=0)
    for row_multiple, rows in ((0, 3), (1, None)):  # a GPU's rounding, a CPU's rows as they come
        bt = Batcher(cfg, EAGLE3, CPU, True, 256, row_multiple, 0, 1)
        assert bt.evaluate_rows(tb) == rows
        batches = bt.eval_batches(ex, tb)
        assert sorted(id(e) for b, _ in batches for e in b) == sorted(map(id, ex)) and len(batches) > 2
        shapes = {tuple(bt.host_batch(b, -1, row_sizes=s, rows=rows)["input_ids"].shape) for b, s in batches}
        assert shapes == {(3, 256)} if rows else len(shapes) == 2  # the last batch has fewer rows on a CPU
    target, data = tiny_run_inputs
    common = ["--steps", "2", *PACKS, "--holdout", "12", "--backend", "hf", "--pack", "on"]
    run_train(tmp_path / "tok", target, data, 1, [*common, "--batch-tokens", "768", "--pack-row-multiple", "3"])
    run_train(tmp_path / "conv", target, data, 1, [*common, "--batch-size", "4"])
    first = [
        next(r for r in map(json.loads, open(tmp_path / n / "metrics.jsonl")) if r["split"] == "eval")
        for n in ("tok", "conv")
    ]
    assert first[0]["step"] == first[1]["step"] == 0
    for k in ("loss_0", "loss_2", "acc_0", "acc_2"):
        assert first[0][k] == pytest.approx(first[1][k], rel=1e-5, abs=1e-7), k


def test_eval_with_autograd_in_the_training_steps_shape(tmp_path, tiny_run_inputs, monkeypatch):
    """Where evaluation batches have the training step's shape (one rank), Trainer.evaluate runs with autograd
    on, so flex and a compiled step reuse the training graphs instead of compiling no_grad ones: the same
    figures as a no_grad evaluation, no gradients left on the draft, and its loss graphs let go."""
    from core.trainer import Trainer  # heavy (the whole training stack): only this test builds one in-process

    target, data = tiny_run_inputs
    cfg = TrainConfig(
        target=str(target),
        data=str(data),
        num_records=60,
        holdout=12,
        max_len=256,
        batch_tokens=768,
        pack="on",
        pack_row_multiple=3,
        ttt_length=3,
        device="cpu",
        out=str(tmp_path / "run"),
        progress=False,
    )
    tr = Trainer(cfg)
    forward, modes = tr.forward, []

    def spy(*a, **kw):
        modes.append(torch.is_grad_enabled())
        out = forward(*a, **kw)
        assert out[0].requires_grad == modes[-1]
        return out

    monkeypatch.setattr(tr, "forward", spy)
    with_grad = tr.evaluate()
    assert modes and all(modes) and all(p.grad is None for p in tr.draft.parameters())
    monkeypatch.setattr(tr.batcher, "row_multiple", 1)  # rows as they come: no padding rows, no_grad
    modes.clear()
    no_grad = tr.evaluate()
    assert modes and not any(modes)
    assert with_grad.keys() == no_grad.keys()
    for k, v in no_grad.items():
        assert with_grad[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_pad_batch_rows():
    """Rows of padding: one padding document each, nothing trained, the real rows untouched; bucket
    keeps the row counts to four per octave."""
    ex = [Example([1, 2, 3], [0, 1, 1]), Example([4, 5, 6, 7, 8], [0, 0, 1, 1, 1]), Example([9] * 6, [1] * 6)]
    b = pack(ex, row_len=8)
    assert b["input_ids"].shape == (2, 8)
    assert pad_batch_rows(b, 2) is b
    p = pad_batch_rows(b, 8)
    for k in ("input_ids", "loss_mask", "attention_mask", "doc_ids", "position_ids"):
        assert p[k].shape == (8, 8) and p[k].dtype == b[k].dtype and torch.equal(p[k][:2], b[k]), k
    assert (p["doc_ids"][2:] == -1).all() and not p["loss_mask"][2:].any() and not p["attention_mask"][2:].any()
    assert torch.equal(p["position_ids"][2:], torch.arange(8).expand(6, 8)) and torch.equal(p["where"], b["where"])
    with pytest.raises(AssertionError, match="cannot be padded"):
        pad_batch_rows(b, 1)
    got = [bucket(r) for r in range(1, 300)]
    assert [bucket(r) for r in (1, 4, 5, 8, 9, 11, 28, 29, 33, 64, 65)] == [1, 4, 5, 8, 10, 12, 28, 32, 40, 64, 80]
    assert all(r <= g < 1.25 * r + 1 for r, g in zip(range(1, 300), got)) and all(bucket(g) == g for g in got)
    assert set(got[32:64]) == {40, 48, 56, 64}  # 33..64 rows: four shapes


def test_token_batches_plan():
    """--batch-tokens: every step has the same row count, no row over its length, each example at most
    once an epoch (only an epoch's last rows short of a step wait), rows nearly full; ranks split a step's
    rows in order (one rank trains what two do), and the plan is a pure function of its inputs (resume)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 300, (500,), generator=g).tolist()
    rows = plan_rows(lengths, list(range(500)), 512)
    assert sorted(i for r in rows for i in r) == list(range(500))
    assert all(sum(lengths[i] for i in r) <= 512 for r in rows)
    assert sum(lengths) / (512 * len(rows)) > 0.95  # first-fit over a window of open rows: nearly full
    assert all(r == sorted(r) for r in rows)  # a row's examples in the order they came
    with pytest.raises(ValueError, match="example 1 has 600 tokens"):
        plan_rows([10, 600], [0, 1], 512)

    tb = TokenBatches(lengths, rows=8, row_len=512, seed=3)
    per = tb.per_epoch
    assert (
        per
        == len(
            plan_rows(lengths, torch.randperm(500, generator=torch.Generator().manual_seed(3_000_009)).tolist(), 512)
        )
        // 8
    )
    for epoch in (0, 1):
        seen = [i for s in range(epoch * per, (epoch + 1) * per) for i in tb.indices(s)]
        assert len(seen) == len(set(seen)) > 0.9 * 500
    for s in (0, per - 1, per, 2 * per + 3):  # within and across epochs
        one = tb.step_rows(s)
        assert len(one) == 8 and all(sum(lengths[i] for i in r) <= 512 for r in one)
        assert tb.step_rows(s, 0, 2) + tb.step_rows(s, 1, 2) == one
        assert tb.indices(s, 1, 2) == [i for r in one[4:] for i in r] and tb.first(s, 1, 2) == sum(map(len, one[:4]))
        assert TokenBatches(lengths, 8, 512, 3).step_rows(s) == one  # a fresh plan (resume) gives the same step
    assert TokenBatches(lengths, 8, 512, 4).step_rows(0) != tb.step_rows(0)
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        tb.step_rows(0, 0, 3)
    with pytest.raises(DataError, match="fewer than one step"):
        TokenBatches(lengths[:10], rows=8, row_len=512, seed=0)


def test_pack_given_rows():
    """pack(row_sizes=...) puts the examples into the rows as given, in order; a row over its length is an error."""
    ex = [Example([1, 2, 3], [0, 1, 1]), Example([4, 5], [1, 1]), Example([6] * 4, [1] * 4)]
    b = pack(ex, row_len=6, row_sizes=[2, 1])
    assert b["where"].tolist() == [[0, 0], [0, 3], [1, 0]]
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 6, 6, 6, 0]]
    assert b["doc_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, -1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    with pytest.raises(ValueError, match="row 0 holds 9 tokens"):
        pack(ex, row_len=6, row_sizes=[3])
    with pytest.raises(ValueError, match="do not add up"):
        pack(ex, row_len=6, row_sizes=[1, 1])


def test_what_cannot_pack_is_named():
    """train.py packs only where documents stay apart: otherwise --pack on refuses and auto runs unpacked."""
    ok = TrainConfig()
    assert packing_blocker(ok, FAMILIES["eagle3"], "cpu", "sdpa") is None
    assert all(
        packing_blocker(dataclasses.replace(ok, strategy=n), s, "cpu", None) is None for n, s in FAMILIES.items()
    )
    cases = [
        (ok, dataclasses.replace(FAMILIES["eagle3"], packs=False), "cpu", None, "does not keep packed documents apart"),
        (
            dataclasses.replace(ok, attention="lse"),
            FAMILIES["eagle3"],
            "cuda",
            None,
            "--attention lse has no document mask on the GPU",
        ),
        (ok, FAMILIES["eagle3"], "cpu", "flash_attention_2", "'flash_attention_2' attention"),
    ]
    for cfg, strategy, kind, attn, message in cases:
        assert message in packing_blocker(cfg, strategy, kind, attn)
    assert packing_blocker(dataclasses.replace(ok, attention="flex"), FAMILIES["eagle3"], "cuda", "eager") is None
    # the compiled step builds its document masks in the graph (test_compiled_packed_step_equals_eager_rows);
    # on a GPU too since it was measured at speed there (experiments/results/defaults_h100_run2/)
    for kind in ("cpu", "cuda"):
        assert packing_blocker(dataclasses.replace(ok, compile=True), FAMILIES["eagle3"], kind, None) is None


def test_pack_on_refuses_clearly(tmp_path, tiny_run_inputs):
    """--pack on where documents cannot stay apart is a ConfigError naming why (main() prints it as one
    'error:' line); --pack auto runs one conversation per row there and says so."""
    said = []
    for mode in ("on", "auto"):
        cfg = dataclasses.replace(TrainConfig(), attention="lse", pack=mode)
        if mode == "on":
            with pytest.raises(ConfigError, match="--pack on: --attention lse has no document mask on the GPU"):
                packing(cfg, FAMILIES["eagle3"], None, "cuda", said.append)
        else:
            assert packing(cfg, FAMILIES["eagle3"], None, "cuda", said.append) is False
            assert "one conversation per row" in said[-1]
    target, data = tiny_run_inputs
    p = run_train(tmp_path / "y", target, data, 0, ["--steps", "1", "--pack", "maybe"], check=False)
    assert p.returncode != 0 and "--pack must be auto, on or off, got 'maybe'" in p.stderr


def test_throughput_windows(monkeypatch):
    """Tokens per second leave out the warm-up steps and paused time (eval, checkpoints);
    MFU = model FLOPs / time / peak."""
    clock = [0.0]
    monkeypatch.setattr(runlog.time, "perf_counter", lambda: clock[0])
    syncs = []
    t = runlog.Throughput(flops_per_token=10.0, n_devices=2, peak=100.0)
    for real, rows, dt in [(50, 64, 9.0), (60, 64, 1.0)]:  # warm-up: the slow first step and the second are left out
        clock[0] += dt
        t.step(real, rows, lambda: syncs.append(clock[0]))
    assert syncs == [10.0] and t.report(lambda xs: xs) == {}
    for real, rows in [(40, 64), (30, 64)]:
        clock[0] += 2.0
        t.step(real, rows, None)
    t.pause(lambda: None)
    clock[0] += 100.0  # an evaluation
    t.resume()
    out = t.report(lambda xs: [3 * x for x in xs])  # three ranks' worth of tokens
    assert out == {
        "real_tokens_per_s": 210 / 4.0,
        "row_tokens_per_s": 384 / 4.0,
        "step_seconds": 2.0,
        "mfu": 10.0 * 210 / 4.0 / (2 * 100.0),
    }
    assert (t.total_real, t.total_rows) == (180, 256)
    clock[0] += 1.0
    t.step(10, 16, None)
    assert t.report(lambda xs: xs)["real_tokens_per_s"] == 10.0  # a new window after each report
    no_count = runlog.Throughput(None, 1, 100.0)  # a family without a FLOP count: throughput, no MFU
    for _ in range(3):
        clock[0] += 1.0
        no_count.step(8, 8, lambda: None)
    assert set(no_count.report(lambda xs: xs)) == {"real_tokens_per_s", "row_tokens_per_s", "step_seconds"}
