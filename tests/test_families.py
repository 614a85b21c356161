"""Every family in models/families.py, reached through the registry alone (no family's class or name
is written here): it trains (its build / host / make_batch / counts / step lower the loss), its
checkpoint loads back, export.py writes every engine format it declares and reads it back to the
same tensors, and evaluate.py's decoding loop drafts with its proposer and emits plain greedy
decoding. A new family gets all of this by its one line in the registry."""

import json
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from core.speculative import TargetRunner, proposer_for, speculative_generate
from core.train_config import ConfigError, TrainConfig, parse_cli, validate
from data.datasets import collate
from export import export, load_checkpoint, load_exported
from models.families import FAMILIES, FAMILY_OPTIONS
from models.proposer import Proposer
from tests.test_packing import _draft_setup, _strategy_step


def _config(name: str) -> TrainConfig:
    f = FAMILIES[name]
    small = {"ttt_length": 3, "num_anchors": 3, "draft_vocab_size": 64}
    return TrainConfig(
        strategy=name,
        attention="eager",
        loss="torch" if f.losses else "auto",  # only the families that read --loss take one
        objective=f.objectives[0],
        **{k: v for k, v in small.items() if k not in FAMILY_OPTIONS or k in f.options},
    )


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_exports_and_decodes(tmp_path, name):
    f, cfg = FAMILIES[name], _config(name)
    validate(cfg, world=1)
    target, _, ex = _draft_setup(seed=3)
    torch.manual_seed(0)
    tok = SimpleNamespace(all_special_ids=[], added_tokens_decoder={})
    draft = f.build(cfg, target, torch.rand(target.config.vocab_size), tok)
    assert draft.family == name and type(draft) is f.draft_cls and type(draft.config) is f.config_cls

    # trains: a few AdamW steps on one batch lower its loss
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    b = collate(ex)
    losses = []
    for _ in range(6):
        loss, stats, counts, _ = _strategy_step(name, cfg, target, draft, b)
        assert (
            counts.shape == (cfg.ttt_length, 2)
            and (counts[:, 1] > 0).any()
            and stats["loss_sum"].shape == (cfg.ttt_length,)
        )
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses

    # the checkpoint train.py writes loads back through the registry
    ck = tmp_path / "ckpt" / "step_6"
    ck.mkdir(parents=True)
    (ck / "config.json").write_text(json.dumps({"strategy": name, "draft": draft.config.to_dict(), "target": None}))
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, ck / "draft.safetensors")
    (tmp_path / "ckpt" / "latest").write_text("step_6")
    loaded, meta = load_checkpoint(tmp_path)
    assert meta["strategy"] == name and type(loaded) is f.draft_cls
    for k, v in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k

    # export: every engine format it declares, read back to the same tensors
    for engine in f.serving.engines if f.serving else ():
        out = export(tmp_path, tmp_path / f"export-{engine}", engine=engine, dtype="fp32")
        back, _ = load_exported(out, engine)
        assert type(back) is f.draft_cls and back.config.aux_layers == draft.config.aux_layers
        for k, v in draft.state_dict().items():
            assert torch.equal(back.state_dict()[k], v), (engine, k)

    # decodes: evaluate.py's loop with the family's proposer emits the target's own greedy tokens
    hf = target.model
    runner = TargetRunner(hf, draft.config.aux_layers)
    prompt = ex[0].input_ids[:12]
    want, _ = speculative_generate(runner, Proposer(), prompt, 10)
    got, st = speculative_generate(runner, proposer_for(draft.eval(), hf), prompt, 10)
    assert got == want and st.drafts > 0 and st.draft_tokens > 0


@pytest.mark.parametrize("name", list(FAMILIES))
def test_options_of_other_families_are_refused(name):
    """A family-specific option set for a family that does not read it fails, naming who reads it."""
    f = FAMILIES[name]
    for option in sorted(FAMILY_OPTIONS - f.options):
        value = getattr(TrainConfig(), option)
        bad = TrainConfig(
            strategy=name,
            **{
                option: (not value)
                if isinstance(value, bool)
                else (value + 1 if not isinstance(value, str) else "params")
            },
        )
        with pytest.raises(ConfigError, match=f"--{option.replace('_', '-')} applies to --strategy .* not {name}"):
            validate(bad, world=1)
    validate(TrainConfig(strategy=name), world=1)
    with pytest.raises(ConfigError, match="unknown strategy 'nope'"):
        validate(TrainConfig(strategy="nope"), world=1)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_command_line_takes_a_familys_own_options(name, capsys):
    """train.py's flags: --strategy NAME --help lists NAME's own options and no other family's; a flag of
    another family's option is refused before anything runs (its value too: --no-fc-norm), naming who reads it;
    NAME's own flags parse to the same TrainConfig as keywords do."""
    f = FAMILIES[name]
    with pytest.raises(SystemExit) as e:
        parse_cli(["--strategy", name, "--help"])
    assert e.value.code == 0
    shown = capsys.readouterr().out
    for option in FAMILY_OPTIONS:
        listed = re.search(rf"(?<![\w-])--{option.replace('_', '-')}(?![\w-])", shown) is not None
        assert listed == (option in f.options), option
    for option in sorted(FAMILY_OPTIONS - f.options):
        flag = f"--{option.replace('_', '-')}"
        value = getattr(TrainConfig(), option)
        for given in [flag, f"--no-{flag[2:]}"] if isinstance(value, bool) else [f"{flag}={value}", flag]:
            with pytest.raises(SystemExit, match=f"error: {flag} applies to --strategy .*, not {name}"):
                parse_cli([f"--strategy={name}", given, *([] if "=" in given or isinstance(value, bool) else ["1"])])
    dash = {o: o.replace("_", "-") for o in f.options}
    own = [(dash[o], getattr(TrainConfig(), o)) for o in sorted(f.options)]
    flags = [(f"--{o}" if v else f"--no-{o}") if isinstance(v, bool) else f"--{o}={v}" for o, v in own]
    assert parse_cli(["--strategy", name, *flags]) == TrainConfig(strategy=name)
