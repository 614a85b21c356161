"""EAGLE-3.1 (fc_norm, norm_output), the LK objectives and the divergences (tv, rkl, jsd) against
brute force: every chain drafted token by token through a real KV cache, the loss assembled row by
row from its definition."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import export
from models.eagle3 import LK_KL_DECAY, LK_KL_SCALE, Eagle3Config, Eagle3Draft, local_counts
from tests.test_eagle3_ttt import setup
from tests.test_export import draft_outputs, make_checkpoint
from tests.test_train_e2e import assert_runs_agree, final_params, run_train


def eagle31(draft: Eagle3Draft, fc_norm=True, norm_output=True, seed=0) -> Eagle3Draft:
    """The same draft with the EAGLE-3.1 options on, its new norms randomised (not identity)."""
    c = Eagle3Config(**{**draft.config.to_dict(), "fc_norm": fc_norm, "norm_output": norm_output})
    d = Eagle3Draft(c)
    d.load_state_dict(draft.state_dict(), strict=False)
    g = torch.Generator().manual_seed(seed)
    for name, p in d.named_parameters():
        if name.startswith("fc_norm"):
            p.data = 1 + 0.3 * torch.randn(p.shape, generator=g)
    return d


def brute_rows(draft, batch, lengths, ttt):
    """Per TTT step: list of (draft logits, target p, target top, trained-by-loss) rows."""
    rows = [[] for _ in range(ttt)]
    for b, n in enumerate(lengths):
        E, aux = batch.embeds[b : b + 1], batch.aux_hidden[b : b + 1]
        for t in range(n - 2):
            h, past = draft.decode(E[:, 1 : t + 2], draft.project(aux[:, : t + 1]), torch.arange(t + 1)[None])
            h = h[:, -1:]
            for k in range(ttt):
                if k > 0:
                    if t + 1 + k >= n:
                        break
                    h, past = draft.decode(E[:, t + 1 + k : t + 2 + k], draft.carry(h), torch.tensor([[t + k]]), past)
                if t + 2 + k >= n or not batch.loss_mask[b, t + 2 + k]:
                    continue
                top = batch.target_top[b, t + 1 + k]
                rows[k].append((draft.logits(h[0, 0]).float(), batch.target_p[b, t + 1 + k], top, bool(draft.t2d[top])))
    return rows


def divergence(z, p, objective):
    """Per-row tv / rkl / jsd between target p and the draft's softmax(z), through F.kl_div."""
    q = z.softmax(-1)
    if objective == "tv":
        return 1 - torch.minimum(p, q).sum(-1)
    if objective == "rkl":  # kl_div(input = log p, target = q) = KL(q || p)
        return F.kl_div(p.log(), q, reduction="none").sum(-1)
    m = (p + q) / 2
    return 0.5 * F.kl_div(m.log(), p, reduction="none").sum(-1) + 0.5 * F.kl_div(m.log(), q, reduction="none").sum(-1)


def reference_loss(rows, objective):
    total = 0.0
    for k, rk in enumerate(rows):
        trained = [(z, p) for z, p, _, ok in rk if ok]
        if not trained:
            continue
        z = torch.stack([z for z, _ in trained])
        p = torch.stack([p for _, p in trained])
        alpha = torch.minimum(p, z.softmax(-1)).sum(-1)
        ce = -(p * z.log_softmax(-1)).sum(-1)
        if objective == "kl":
            lk = ce.mean()
        elif objective in ("tv", "rkl", "jsd"):
            lk = divergence(z, p, objective).mean()
        elif objective == "lk-alpha":
            lk = -torch.log(alpha.mean())
        else:
            w = LK_KL_SCALE * torch.exp(-LK_KL_DECAY * alpha.mean().detach())
            lk = w * ce.mean() + (1 - w) * (1 - alpha.mean())
        total = total + 0.8**k * lk
    return total


@pytest.mark.parametrize("objective", ["kl", "lk-alpha", "lk-lambda", "tv", "rkl", "jsd"])
@pytest.mark.parametrize("options", [(False, False), (True, True), (False, True)])
def test_eagle31_and_lk_match_brute_force(objective, options):
    draft, batch, lengths, ttt = setup(seed=1)
    draft = eagle31(draft, *options)
    counts = local_counts(batch, draft.t2d, ttt)
    loss, stats = draft(batch, ttt, counts, attention="lse", objective=objective)
    grads = torch.autograd.grad(loss, list(draft.parameters()))
    rows = brute_rows(draft, batch, lengths, ttt)
    ref = reference_loss(rows, objective)
    ref_grads = torch.autograd.grad(ref, list(draft.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)
    correct = [sum(int(draft.draft_ids[z.argmax()] == top) for z, _, top, _ in rk) for rk in rows]
    assert stats["correct"].tolist() == correct
    if objective in ("rkl", "jsd"):  # logged: Σ divergence over the trained rows
        for k, rk in enumerate(rows):
            want = sum(divergence(z[None], p[None], objective).sum() for z, p, _, ok in rk if ok)
            torch.testing.assert_close(stats["loss_sum"][k], torch.as_tensor(want).float(), rtol=1e-5, atol=1e-5)
    elif objective != "kl":  # logged loss_k = 1 - mean α over the trained rows (tv: the same per row)
        for k, rk in enumerate(rows):
            one_minus = sum(1 - torch.minimum(p, z.softmax(-1)).sum() for z, p, _, ok in rk if ok)
            torch.testing.assert_close(stats["loss_sum"][k], torch.as_tensor(one_minus).float(), rtol=1e-5, atol=1e-5)


def test_lk_alpha_lowers_the_loss_it_reports():
    """A few SGD steps on -log α raise the batch acceptance (the objective is not just a number)."""
    draft, batch, _, ttt = setup(seed=0)
    counts = local_counts(batch, draft.t2d, ttt)
    opt = torch.optim.SGD(draft.parameters(), lr=0.5)
    first = None
    for _ in range(15):
        loss, stats = draft(batch, ttt, counts, attention="lse", objective="lk-alpha")
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < first - 0.1


def test_export_writes_eagle31_fields(tmp_path, capsys):
    run, d, _ = make_checkpoint(tmp_path)
    d31 = eagle31(d)
    step = run / "ckpt" / "step_7"
    save_file({k: v.contiguous() for k, v in d31.state_dict().items()}, step / "draft.safetensors")
    meta = json.loads((step / "config.json").read_text())
    meta["draft"] = d31.config.to_dict()
    (step / "config.json").write_text(json.dumps(meta))
    out = export.export(run, tmp_path / "served", dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True  # the fields vLLM's llama_eagle3 reads
    sd = load_file(out / "model.safetensors")
    assert [k for k in sd if k.startswith("fc_norm")] == [
        f"fc_norm.{i}.weight" for i in range(len(d.config.aux_layers))
    ]
    back, _ = export.load_exported(out)
    assert back.config == d31.config
    (l0, _), (l1, _) = draft_outputs(d31), draft_outputs(back)
    assert torch.equal(l0, l1)
    # SGLang: the same tensors, and a note that an SGLang without EAGLE-3.1 support drops them silently
    export.main(export.ExportArgs(str(run), out=str(tmp_path / "sglang"), engine="sglang", dtype="fp32"))
    assert "EAGLE-3.1 draft" in capsys.readouterr().out
    export.main(export.ExportArgs(str(run), out=str(tmp_path / "vllm"), engine="vllm", dtype="fp32"))
    assert "EAGLE-3.1 draft" not in capsys.readouterr().out


def test_lk_two_ranks_match_one_rank(tmp_path, tiny_run_inputs):
    """The LK batch mean is global: two gloo ranks follow the one-rank run (EAGLE-3.1 on)."""
    target, data = tiny_run_inputs
    extra = ["--steps", "3", "--objective", "lk-alpha", "--fc-norm", "--norm-output"]
    run_train(tmp_path / "one", target, data, 1, extra)
    run_train(tmp_path / "two", target, data, 2, extra)
    assert any(k.startswith("fc_norm") for k in final_params(tmp_path / "one"))
    assert_runs_agree(tmp_path / "one", tmp_path / "two")
