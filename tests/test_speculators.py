"""The speculators format (vLLM's own trainer, 0.9.0) both ways, and imports of SafeAILab / SpecForge
EAGLE-3 dirs: ours -> theirs -> ours is bit for bit (fp32) for every family vLLM 0.32 reads in that
format; the config fields are the ones vLLM's speculators reader (algos.py) turns into the same
draft config as our vLLM-format export; broken or foreign inputs fail naming the file; train.py
--init-draft continues from an imported draft. The slow test serves both formats of the shipped
draft in vLLM's CPU build: same tokens, same counters."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import export
from core.speculative import Proposer, TargetRunner, speculative_generate
from core.vllm_spec import DEFAULT_VENV, ensure_venv, run_job
from data.benchmarks import load_prompts
from data.chat import render
from models.dflash import DFlashConfig, DFlashDraft
from models.dspark import DSparkConfig, DSparkDraft
from models.eagle3 import Eagle3Config, Eagle3Draft
from models.peagle import PEagleConfig, PEagleDraft
from models.target import Target, default_aux_layers
from tests.test_dflash import save_run
from tests.test_train_e2e import run_train
from tests.tiny import tiny_llama

FAMILIES = ("eagle3", "peagle", "dflash", "dspark")


def tiny_run(root, family, seed=0, draft_vocab=40, aux_layers=(0, 2, 3), **options):
    """A random tiny draft of `family` saved as train.py saves it, beside its tiny target (5 layers); its
    aux layers are distinct (the default ones of 5 layers are [1, 1, 1], which hide order mix-ups)."""
    hf = tiny_llama(seed=seed, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    aux, tc = Target(hf, list(aux_layers) if aux_layers else None).aux_layers, hf.config
    torch.manual_seed(seed)
    if family in ("eagle3", "peagle"):
        cls, cfg_cls = (Eagle3Draft, Eagle3Config) if family == "eagle3" else (PEagleDraft, PEagleConfig)
        extra = {"mask_token_id": 7, "depths": 5} if family == "peagle" else {}
        d = cls(cfg_cls.from_target(tc, draft_vocab, aux, **extra, **options))
    else:
        cls, cfg_cls = (DFlashDraft, DFlashConfig) if family == "dflash" else (DSparkDraft, DSparkConfig)
        extra = {"markov_rank": 8} if family == "dspark" else {}
        d = cls(cfg_cls.from_target(tc, aux, 4, mask_token_id=5, num_layers=2, **extra))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if family in ("eagle3", "peagle"):
        ids = torch.randperm(tc.vocab_size)[:draft_vocab].sort().values
        d.d2t.copy_(ids - torch.arange(draft_vocab))
        d.t2d.zero_()
        d.t2d[ids] = True
    return save_run(root, d, hf, family), d, hf


def assert_same_draft(ckpt, d):
    back, meta = export.load_checkpoint(ckpt)
    assert back.config == d.config and meta["strategy"] == d.family
    sd = back.state_dict()
    assert sd.keys() == d.state_dict().keys()
    for k, v in d.state_dict().items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k
    return meta


@pytest.mark.parametrize("family", FAMILIES)
def test_speculators_roundtrip_is_exact(tmp_path, family):
    run, d, _ = tiny_run(tmp_path, family)
    out = export.export(run, tmp_path / "spec", engine="speculators", dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert "model_type" not in cfg  # vLLM picks its SpeculatorsConfig by the absence of model_type
    assert cfg["speculators_model_type"] == family
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str((tmp_path / "target").resolve())
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or cfg["aux_hidden_state_layer_ids"]
    assert ids == [i + 1 for i in d.config.aux_layers] == [1, 3, 4]  # vLLM ids: HF hidden_states indices
    k = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert k == {"eagle3": 3, "peagle": 5, "dflash": 3, "dspark": 4}[family]
    names = set(load_file(out / "model.safetensors"))
    if family in ("eagle3", "peagle"):
        assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
        assert cfg["norm_before_residual"] is False  # vLLM reads a missing one as True for eagle3
    served, _ = export.load_exported(out)  # evaluate.py / gate.py read the dir as it is too
    assert served.config == d.config and all(torch.equal(served.state_dict()[k], v) for k, v in d.state_dict().items())
    back = export.import_draft(out, tmp_path / "imported")
    meta = assert_same_draft(back, d)
    assert (
        meta["imported_from"]["format"] == "speculators"
        and meta["target"] == cfg["speculators_config"]["verifier"]["name_or_path"]
    )
    # and our vLLM-format dir imports the same way (auto-detected by its provenance)
    assert_same_draft(export.import_draft(export.export(run, tmp_path / "vllm", dtype="fp32"), tmp_path / "i2"), d)


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_reads_both_formats_alike(tmp_path, family):
    """vLLM 0.32's speculators reader (transformers_utils/configs/speculators/algos.py, pure Python: run
    here from the vLLM venv's file) turns our speculators config into the draft config our vLLM-format
    export writes, on every field its loaders read."""
    ensure_venv(DEFAULT_VENV)  # built here if no earlier test did (the gate tests build it too)
    algos = next(DEFAULT_VENV.glob("lib/python3*/site-packages/vllm/transformers_utils/configs/speculators/algos.py"))
    spec = importlib.util.spec_from_file_location("vllm_speculators_algos", algos)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    run, d, _ = tiny_run(tmp_path, family)
    theirs = json.loads((export.export(run, tmp_path / "s", engine="speculators") / "config.json").read_text())
    ours = json.loads((export.export(run, tmp_path / "v") / "config.json").read_text())
    got = json.loads(json.dumps(theirs["transformer_layer_config"]))
    mod.SUPPORTED_SPECULATORS_TYPES[theirs["speculators_model_type"]](theirs, got)
    common = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"}
    common |= {"head_dim", "rms_norm_eps", "vocab_size", "rope_parameters", "max_position_embeddings"}
    if family in ("eagle3", "peagle"):
        assert got["architectures"] == [
            {"eagle3": "Eagle3LlamaForCausalLM", "peagle": "PeagleLlamaForCausalLM"}[family]
        ]
        assert got["eagle_aux_hidden_state_layer_ids"] == ours["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        common |= {"draft_vocab_size", "target_hidden_size", "norm_before_residual"}
        common |= {"fc_norm", "norm_output"} if family == "eagle3" else set()
        if family == "peagle":
            assert got["pard_token"] == ours["mask_token_id"]
    else:
        assert got["architectures"] == ours["architectures"]
        tl = got["dflash_config"]["target_layer_ids"] if family == "dflash" else got["target_layer_ids"]
        assert tl == ours["dflash_config"]["target_layer_ids"]
        common |= {"target_hidden_size"}
        if family == "dflash":
            assert got["dflash_config"]["causal"] is ours["dflash_config"]["causal"] is False
            assert got["dflash_config"]["mask_token_id"] == ours["dflash_config"]["mask_token_id"]
        else:  # qwen3_dspark.py: full-vocabulary, anchor-sampling, confidence head
            common |= {"markov_rank", "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"}
            assert (
                got["mask_token_id"] == ours["dflash_config"]["mask_token_id"] and got["dspark_bonus_anchor"] is False
            )
            assert got["draft_vocab_size"] == ours["draft_vocab_size"] == d.config.vocab_size
    assert {k: got.get(k) for k in common} == {k: ours.get(k) for k in common}


def foreign_eagle3(tmp_path, fmt):
    """Our fp32 vLLM export rewritten as the EAGLE repo (pytorch_model.bin, no aux ids: the default layers)
    or SpecForge (model.safetensors with the target's embed_tokens and SGLang-convention ids) writes it."""
    run, d, hf = tiny_run(tmp_path, "eagle3", aux_layers=None if fmt == "safeailab" else (0, 2, 3))
    assert d.config.aux_layers == (default_aux_layers(5) if fmt == "safeailab" else [0, 2, 3])
    served = export.export(run, tmp_path / "served", dtype="fp32")
    cfg = json.loads((served / "config.json").read_text())
    del cfg["nanospec_export"]
    sd = load_file(served / "model.safetensors")
    src = tmp_path / fmt
    src.mkdir()
    if fmt == "safeailab":
        del cfg["eagle_config"]
        torch.save(sd, src / "pytorch_model.bin")
    else:
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = export.engine_aux_ids(d.config.aux_layers, "sglang")
        sd["embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
        save_file(sd, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps(cfg))
    return src, d, tmp_path / "target"


@pytest.mark.parametrize("fmt", ["safeailab", "specforge"])
def test_import_foreign_eagle3_is_exact(tmp_path, fmt):
    src, d, target = foreign_eagle3(tmp_path, fmt)
    assert_same_draft(export.import_draft(src, tmp_path / "a", fmt, target=str(target)), d)
    if fmt == "safeailab":  # no ids and no target: the default layers cannot be known
        with pytest.raises(
            export.ExportError, match=r"config.json: no eagle_aux_hidden_state_layer_ids; pass --target"
        ):
            export.import_draft(src, tmp_path / "b")
    else:  # explicit ids: vLLM and SGLang read them differently, so auto refuses to guess
        with pytest.raises(export.ExportError, match=r"explicit eagle_aux_hidden_state_layer_ids.*--import-from"):
            export.import_draft(src, tmp_path / "b")
        sd = load_file(src / "model.safetensors")
        sd["embed_tokens.weight"] = sd["embed_tokens.weight"] + 1  # a draft that trained its own embeddings
        save_file(sd, src / "model.safetensors")
        with pytest.raises(export.ExportError, match=r"model.safetensors: embed_tokens.weight differs from the target"):
            export.import_draft(src, tmp_path / "c", fmt, target=str(target))


def test_bad_inputs_fail_naming_the_file(tmp_path):
    run, d, _ = tiny_run(tmp_path, "eagle3")
    out = export.export(run, tmp_path / "spec", engine="speculators", dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    with pytest.raises(export.ExportError, match=r"nothing: config.json is missing"):
        export.import_draft(tmp_path / "nothing", tmp_path / "x")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(export.ExportError, match=r"nothing/config.json: not a draft format read here"):
        export.import_draft(tmp_path / "nothing", tmp_path / "x")
    with pytest.raises(export.ExportError, match=r"nothing: no model.safetensors or pytorch_model.bin"):
        export.import_draft(tmp_path / "nothing", tmp_path / "x", "safeailab")
    sd = load_file(out / "model.safetensors")
    sd["fc.weight"] = sd["fc.weight"][:, :-1].contiguous()
    save_file(sd, out / "model.safetensors")
    with pytest.raises(export.ExportError, match=r"spec/model.safetensors: fc.weight has shape"):
        export.import_draft(out, tmp_path / "x")
    for field, value, message in [
        ("speculators_model_type", "mtp", r"speculators_model_type 'mtp' is not read here"),
        ("norm_before_residual", True, r"norm_before_residual is set"),
    ]:
        (out / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(export.ExportError, match=message):
            export.import_draft(out, tmp_path / "x")
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "norm_before_residual"}))
    with pytest.raises(export.ExportError, match=r"norm_before_residual is set"):  # vLLM's default for eagle3
        export.import_draft(out, tmp_path / "x")
    # export refusal: an EAGLE-3.1 P-EAGLE draft (vLLM 0.32's peagle reader drops fc_norm / norm_output)
    run31, _, _ = tiny_run(tmp_path / "p31", "peagle", fc_norm=True)
    with pytest.raises(export.ExportError, match=r"peagle: vLLM 0.32's speculators reader drops fc_norm"):
        export.export(run31, tmp_path / "y", engine="speculators")
    # the CLI both ways: python export.py RUN --engine speculators; python export.py DIR --import-from auto --out RUN
    spec = export.main(export.ExportArgs(ckpt=str(run), out=str(tmp_path / "cli"), engine="speculators", dtype="fp32"))
    assert_same_draft(export.main(export.ExportArgs(ckpt=str(spec), out=str(tmp_path / "r"), import_from="auto")), d)
    with pytest.raises(SystemExit, match=r"import failed: .*void: config.json is missing"):
        export.main(export.ExportArgs(ckpt=str(tmp_path / "void"), out=str(tmp_path / "q"), import_from="auto"))


@pytest.mark.slow
def test_vllm_serves_the_speculators_export_like_ours(tmp_path, smollm2_dir, smollm2_tokenizer):
    """The shipped draft imported (bf16 -> fp32 checkpoint), exported both ways in fp32 and served by
    vLLM 0.32's CPU build on SmolLM2: the speculators dir natively (`LLM(model=DIR)`: vLLM reads the
    method, K = 3 and the target from its config), ours with an explicit speculative_config. Both
    give plain greedy decoding's tokens and the same spec-decode counters."""
    from transformers import AutoModelForCausalLM  # heavy (transformers): not at module import

    draft = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-eagle3"
    ck = export.import_draft(draft, tmp_path / "run", target=str(smollm2_dir))
    spec = export.export(ck, tmp_path / "spec", engine="speculators", dtype="fp32")
    ours = export.export(ck, tmp_path / "vllm", dtype="fp32")
    prompts = [render(smollm2_tokenizer, [{"role": "user", "content": t[0]}]) for t in load_prompts("gsm8k", 2)]
    job = {"k": 3, "prompts": prompts, "max_tokens": 32, "ignore_eos": True, "batch": False}
    job["servers"] = [{"target": str(spec), "draft": None}, {"target": str(smollm2_dir), "draft": str(ours)}]
    theirs, mine = run_job(job, log_path=tmp_path / "vllm.log")["runs"]
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    greedy = [speculative_generate(TargetRunner(model), Proposer(), p, 32)[0] for p in prompts]
    assert theirs["outputs"] == mine["outputs"] == greedy
    assert theirs["metrics"] == mine["metrics"] and theirs["per_prompt"] == mine["per_prompt"]
    m = theirs["metrics"]
    # K = 3 read from the speculators config; τ = 1 + accepted / drafts (1.80 measured here) beats n-gram's ~1.6
    assert m["num_draft_tokens"] == 3 * m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0.7 * m["num_drafts"]
    print(json.dumps({"speculators": theirs["metrics"], "vllm": mine["metrics"]}))


def test_train_continues_from_an_imported_draft(tmp_path, tiny_run_inputs):
    """train.py --init-draft on a draft that went ours -> speculators -> ours: the new run's first held-out
    evaluation equals the source run's last one (same weights, same d2t); another config is refused."""
    target, data = tiny_run_inputs
    run_train(tmp_path / "a", target, data, 0, ["--steps", "3"])
    spec = export.export(tmp_path / "a", tmp_path / "spec", engine="speculators", dtype="fp32")
    export.import_draft(spec, tmp_path / "imported")
    run_train(tmp_path / "b", target, data, 0, ["--steps", "1", "--init-draft", str(tmp_path / "imported")])

    def evals(run):
        return [r for r in map(json.loads, open(run / "metrics.jsonl")) if r["split"] == "eval"]

    a_end, b_start = evals(tmp_path / "a")[-1], evals(tmp_path / "b")[0]
    assert b_start["step"] == 0 and a_end["step"] == 3

    def numbers(r):
        return {k: v for k, v in r.items() if k not in ("step", "time")}

    assert numbers(b_start) == numbers(a_end) != numbers(evals(tmp_path / "a")[0])  # not a fresh draft's
    extra = ["--steps", "1", "--draft-vocab-size", "4096", "--init-draft", str(tmp_path / "imported")]
    p = run_train(tmp_path / "c", target, data, 0, extra, check=False)
    assert (
        p.returncode != 0
        and "config differs from the eagle3 draft these flags build in ['draft_vocab_size']" in p.stderr
    )
