"""optim.MuonAdamW: its AdamW groups equal torch's AdamW, its Muon groups torch's Muon (scaled to AdamW's
RMS), Newton-Schulz orthogonalises, the state round-trips; train.py --optimizer muon on two gloo ranks
equals one rank (FSDP2 DTensor parameters: each rank orthogonalises the full matrix)."""

import copy

import torch

from core.optim import MuonAdamW, muon_groups, muon_matrix, newton_schulz
from tests.test_train_e2e import assert_runs_agree, run_train, train_rows


def test_newton_schulz_orthogonalises():
    g = torch.randn(48, 20, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(g))
    assert s.min() > 0.5 and s.max() < 1.5  # the quintic's band, not exactly 1 (by design)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    o = newton_schulz(g)
    cos = (o * (u @ vh)).sum() / (o.norm() * (u @ vh).norm())
    assert cos > 0.97  # the direction of U V^T


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 7)  # 2-D weight: Muon; bias: AdamW
        self.lm_head = torch.nn.Linear(7, 5, bias=False)  # the head stays on AdamW

    def forward(self, x):
        return self.lm_head(torch.tanh(self.fc(x))).square().mean()


def _train(opt_of, steps=4):
    torch.manual_seed(0)
    net = Net()
    opt = opt_of(net)
    x = torch.randn(9, 12)
    for _ in range(steps):
        net(x).backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def _torch_pair(m, lr, wd):
    """torch's Muon (bf16 Newton-Schulz, AdamW-RMS scaling) for fc.weight, torch's AdamW for the rest."""
    muon = torch.optim.Muon([m.fc.weight], lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(
        [{"params": [m.lm_head.weight], "weight_decay": wd}, {"params": [m.fc.bias], "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    class Both:
        def step(self):
            muon.step(), adamw.step()

        def zero_grad(self):
            muon.zero_grad(), adamw.zero_grad()

    return Both()


def test_groups_match_torch_adamw_and_muon():
    assert [muon_matrix(n, p) for n, p in Net().named_parameters()] == [True, False, False]
    lr, wd = 3e-3, 0.1
    # one step: the same gradients reach both, so the AdamW parts agree exactly and Muon's up to bf16
    ours, _ = _train(lambda m: MuonAdamW(muon_groups(m.named_parameters(), wd), lr=lr), steps=1)
    ref, _ = _train(lambda m: _torch_pair(m, lr, wd), steps=1)
    torch.testing.assert_close(ours.lm_head.weight, ref.lm_head.weight, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ours.fc.bias, ref.fc.bias, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ours.fc.weight, ref.fc.weight, rtol=0, atol=5e-5)  # lr-sized update, bf16 there
    torch.manual_seed(0)
    moved = (ours.fc.weight - Net().fc.weight).abs()  # from _train's initial weights
    assert 1e-4 < moved.max() < 0.1
    # several steps, the AdamW update alone (every group muon=False) against torch's AdamW
    groups = lambda m: [dict(g, muon=False) for g in muon_groups(m.named_parameters(), wd)]  # noqa: E731
    ours, _ = _train(lambda m: MuonAdamW(groups(m), lr=lr), steps=5)
    ref, _ = _train(lambda m: torch.optim.AdamW(groups(m), lr=lr, betas=(0.9, 0.95), eps=1e-8), steps=5)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_state_round_trips():
    net, opt = _train(lambda m: MuonAdamW(muon_groups(m.named_parameters(), 0.1), lr=3e-3), steps=2)
    twin = copy.deepcopy(net)
    opt2 = MuonAdamW(muon_groups(twin.named_parameters(), 0.1), lr=3e-3)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    x = torch.randn(9, 12)
    for m, o in ((net, opt), (twin, opt2)):
        m(x).backward()
        o.step()
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_train_muon_two_ranks_match_one_rank(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    extra = ["--steps", "4", "--optimizer", "muon", "--pack", "off"]
    run_train(tmp_path / "one", target, data, 1, extra)
    run_train(tmp_path / "two", target, data, 2, extra)
    one = train_rows(tmp_path / "one")
    assert len(one) == 4 and one[-1]["loss"] != one[0]["loss"]
    assert_runs_agree(tmp_path / "one", tmp_path / "two", keys=("loss",))
