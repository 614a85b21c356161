"""Training checkpoint -> serving directory (for vLLM or SGLang in their own format, or in speculators'),
and drafts made elsewhere -> training checkpoint.

    python export.py runs/default [--out DIR] [--engine vllm|sglang|speculators] [--dtype bf16|fp32] [--with-embeddings]
    python export.py SRC --import-from auto|speculators|safeailab|specforge --out RUN [--target DIR]

The input is a checkpoint dir (<run>/ckpt/step_N), a run dir (its ckpt/latest is taken) or a
run's ckpt/ dir. The output dir holds config.json + model.safetensors in the format the engine
loads (DESIGN.md, "Serving formats"). This file is the plumbing every format shares (finding and
checking checkpoints, the output dir, provenance, the speculators wrapper, import) and names no
family: each family's `Serving` (models/family.py) writes and reads its layout, whose key names,
tensor shapes and the engine-code facts behind them are in models/eagle_serving.py and
models/block_serving.py; the engines' aux-layer id conventions are in models/engines.py. A family
whose `serving` is None (no engine loader in reach) is not exported.

speculators (vLLM's own trainer, 0.9.0; `--engine speculators`): the tensors of the vLLM dir (a layout
may rename some: `Serving.speculators_names`) under the config.json `vllm serve DIR` loads with no
speculative config (vLLM 0.32 transformers_utils/configs/speculators/: a config with speculators_config
and no model_type is read by its SpeculatorsConfig): speculators_model_type, transformer_layer_config
(the layer fields, LAYER_FIELDS), the family's fields (`Serving.to_speculators`), and speculators_config
{algorithm, proposal_methods [{proposal_type greedy, speculative_tokens K}], verifier {name_or_path =
the target dir, architectures}}; vLLM takes the method, K and the target from it. Every family whose
`Serving.speculators` names a type is written (checked: tests/test_speculators.py runs vLLM's reader on
each and serves the shipped draft both ways on the CPU build: same tokens, same counters).

Import (`--import-from`; import_draft) writes <out>/ckpt/step_0/{draft.safetensors, config.json} +
ckpt/latest, which load_checkpoint, evaluate.py and gate.py read (no train_state.pt: a fresh run
starts from it with train.py --init-draft). Formats: speculators (above), the dirs of other trainers
that a layout reads (`Serving.foreign`): SafeAILab (the EAGLE repo: pytorch_model.bin or
model.safetensors, usually no aux ids: the engines' defaults, which need --target for the layer count)
and SpecForge (model.safetensors; explicit ids are read as SGLang's, the engine SpecForge trains for),
and our own serving dirs (their provenance names the engine). `auto` refuses to guess the convention
of explicit ids in a foreign dir. embed_tokens.weight is dropped (our drafts share the target's),
refused if it differs from the target's; speculators' verifier_* copies are dropped; variants we do
not implement fail (the layouts say which).
"""

import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from core.checkpoint import write_checkpoint
from core.distributed import DTYPES
from core.runlog import RUN_FILES, clear_previous_run, os_why, output_kind, previous_run
from data.chat import DataError
from models.engines import ENGINES, ROPE_FIELDS, ExportError
from models.engines import engine_aux_ids as engine_aux_ids  # re-exported: tools and tests import it from here
from models.families import FAMILIES, family_of
from models.families import load_draft as load_family_draft
from models.family import Family
from models.target import TargetError, load_tokenizer, resolve_target


# ---- training checkpoints ----
def read_tensors(f: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, or an ExportError naming it (truncated, corrupted, missing) and the intact-looking
    checkpoints beside it."""
    try:
        return load_file(f)
    except Exception as e:  # SafetensorError (bad header, short buffer), OSError, ...
        why = str(e).splitlines()[0][:200] if str(e) else ""
        others = sorted(
            (
                d.name
                for d in f.parent.parent.glob("step_*")
                if d != f.parent and (d / f.name).exists() and d.name[5:].isdigit()
            ),
            key=lambda n: -int(n[5:]),
        )
        hint = (
            f"; other checkpoints beside it: {', '.join(others)} (pass one's directory)"
            if others and f.parent.name.startswith("step_")
            else ""
        )
        raise ExportError(
            f"{f} is damaged or unreadable ({type(e).__name__}{': ' + why if why else ''}){hint}"
        ) from None


def read_json(f: Path) -> dict:
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{f} is damaged or unreadable ({type(e).__name__}: {e})") from None


def find_checkpoint(path: str | Path) -> Path:
    """ckpt/step_N, a run dir (-> ckpt/latest) or a ckpt/ dir (-> latest)."""
    p = Path(path)
    if (p / "draft.safetensors").exists():
        return p
    for ckpt_dir in (p / "ckpt", p):
        latest = ckpt_dir / "latest"
        if latest.exists():
            d = ckpt_dir / latest.read_text().strip()
            if not (d / "draft.safetensors").exists():
                raise ExportError(f"{latest} points to {d}, which has no draft.safetensors")
            return d
    raise ExportError(f"{p}: not a training checkpoint (no draft.safetensors, no ckpt/latest)")


def _draft_from(f: Family, sd: dict, c, where: str) -> torch.nn.Module:
    """f's draft from serving-format tensors. A layout that names every tensor checks them loudly first
    (the strict load then fails only for what it leaves unchecked: MoE drafts); otherwise the strict load
    against the draft config is the check."""
    if f.serving.checks_tensors:
        f.serving.check(sd, c, where)
        draft = f.draft_cls(c)
        draft.load_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in sd.items() if k != "embed_tokens.weight"},
            strict=True,
        )
        return draft.eval()
    draft = f.draft_cls(c)
    try:
        draft.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    except RuntimeError as e:
        raise ExportError(f"{where}: {str(e).splitlines()[0]} {str(e).splitlines()[1:2]}") from None
    return draft.eval()


def load_checkpoint(path: str | Path) -> tuple[torch.nn.Module, dict]:
    """A training checkpoint -> (fp32 draft of its strategy, its config.json {strategy, draft, target})."""
    d = find_checkpoint(path)
    meta_path = d / "config.json"
    if not meta_path.exists():
        raise ExportError(f"{d}: config.json is missing")
    meta = read_json(meta_path)
    try:
        f = family_of(meta.get("strategy"))
    except ValueError as e:
        raise ExportError(f"{d}: {e}") from None
    meta["checkpoint"] = str(d)
    if f.serving and f.serving.checks_tensors:  # the serving format's loud tensor checks first
        try:
            c = f.config_cls(**meta["draft"])
        except (KeyError, TypeError) as e:
            raise ExportError(f"{meta_path}: bad draft config: {e}") from None
        return _draft_from(f, read_tensors(d / "draft.safetensors"), c, str(d / "draft.safetensors")), meta
    try:
        return load_family_draft(meta, read_tensors(d / "draft.safetensors")), meta
    except (KeyError, TypeError, RuntimeError) as e:
        raise ExportError(f"{d}: cannot load the {meta['strategy']} draft: {e}") from None


# ---- serving dirs ----
def tokenizer_digest(tokenizer) -> str:
    """A short fingerprint of a tokenizer's vocabulary (token -> id): two tokenizers with the same
    vocabulary size but other ids would make a draft propose nonsense without any error."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


def target_mismatch(c, tc: dict, tokenizer=None, recorded: dict | None = None) -> list[str]:
    """Why draft config `c` cannot run on the target whose config.json is `tc` ([] = it can):
    hidden size, vocabulary, aux layers, and (when the export recorded one) the tokenizer."""
    tc = tc.get("text_config", tc)
    why = []
    if getattr(c, "target_hidden_size", None) not in (None, tc.get("hidden_size")):
        why.append(
            f"hidden size: the draft reads {c.target_hidden_size}-wide target features, "
            f"the target's are {tc.get('hidden_size')}"
        )
    if c.vocab_size != tc.get("vocab_size"):
        why.append(f"vocabulary: the draft maps to {c.vocab_size} target tokens, the target has {tc.get('vocab_size')}")
    L = tc.get("num_hidden_layers")
    if L is not None and any(not 0 <= i < L for i in getattr(c, "aux_layers", [])):
        why.append(f"aux layers: the draft reads layers {list(c.aux_layers)}, the target has {L} (0..{L - 1})")
    want = (recorded or {}).get("tokenizer")
    if tokenizer is not None and want and tokenizer_digest(tokenizer) != want:
        why.append(
            f"tokenizer: the draft was exported for tokenizer {want}, this target's is {tokenizer_digest(tokenizer)}"
        )
    return why


def _target_config(target_dir: str | Path | None, c) -> dict:
    if target_dir and (Path(target_dir) / "config.json").exists():
        tc = json.loads((Path(target_dir) / "config.json").read_text())
        if why := target_mismatch(c, tc):
            raise ExportError(f"target {target_dir} does not match the draft: {'; '.join(why)}")
        return tc.get("text_config", tc)
    return {}


def export(
    ckpt: str | Path,
    out: str | Path,
    engine: str = "vllm",
    dtype: str = "bf16",
    with_embeddings: bool = False,
    target: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the serving dir; returns it. The write goes through a temporary dir renamed into
    place, so a failed export never leaves a dir that looks complete. An existing `out` is replaced
    only if export wrote it, or with overwrite (check_export_out)."""
    check_export_out(out, find_checkpoint(ckpt), overwrite)
    if engine not in ENGINES:
        raise ExportError(f"unknown engine {engine!r}: choose one of {ENGINES}")
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}: choose one of {tuple(DTYPES)}")
    draft, meta = load_checkpoint(ckpt)
    c, tdtype = draft.config, DTYPES[dtype]
    family, serving = meta["strategy"], FAMILIES[meta["strategy"]].serving
    if serving and (why := serving.unservable(c)):
        raise ExportError(f"{ckpt}: {why}")
    if target:  # given: a target model, or refused (a wrong path was skipped: no fit check, no tokenizer, recorded)
        if kind := output_kind(target):
            raise ExportError(f"--target {target} is {kind}, not a target model")
        target = str(resolve_dir(target))
    target_dir = target or meta.get("target")
    tc = _target_config(target_dir, c)
    if serving is None:
        raise ExportError(f"strategy {family!r}: no serving engine here loads it (README, 'Draft families')")
    if engine not in serving.engines and not (engine == "speculators" and "vllm" in serving.engines):
        names = {"vllm": "vLLM", "sglang": "SGLang"}
        raise ExportError(
            f"{family}: only the {' and '.join(names[e] for e in serving.engines)} format is written"
            + (f" ({serving.missing})" if serving.missing else "")
        )
    prov = {
        "engine": engine,
        "aux_layer_outputs": list(c.aux_layers),
        "target": str(target_dir) if target_dir else None,
        "checkpoint": meta["checkpoint"],
    }
    if tc:  # the tokenizer the draft was trained with, so a target with another one is refused at load
        try:
            prov["tokenizer"] = tokenizer_digest(load_tokenizer(Path(target_dir)))
        except DataError:  # a target dir without tokenizer files (tests' random targets): nothing to record
            pass
    embeddings = (lambda: _target_embeddings(target_dir)) if with_embeddings else None
    cfg, sd, more = serving.write(draft, engine, tc, tdtype, embeddings)
    prov.update(more)
    if engine == "speculators":
        cfg = speculators_config(cfg, c, serving, _verifier(target_dir))
        ours, theirs = serving.speculators_names
        sd = {k.replace(ours, theirs, 1): v for k, v in sd.items()} if ours else sd
    return _write(out, cfg, sd, prov)


EXPORT_MARKER = ".nanospec-export"  # written into every serving dir: the only kind of existing dir export replaces


def _overlaps(a: Path, b: Path) -> bool:
    """a is b, or one holds the other."""
    return a == b or a in b.parents or b in a.parents


def _written_by_export(d: Path) -> bool:
    """A serving dir export wrote: its marker, or (dirs written before the marker) exactly config.json +
    model.safetensors with our provenance in the config."""
    if (d / EXPORT_MARKER).is_file():
        return True
    if {p.name for p in d.iterdir()} != {"config.json", "model.safetensors"}:
        return False
    try:
        return "nanospec_export" in json.loads((d / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_export_out(out: str | Path, ckpt: Path, overwrite: bool = False):
    """--out before anything is read or written. Never the checkpoint being exported, its run's files or a
    directory holding them (refused even with overwrite: replacing --out would delete them); an existing
    directory only if export wrote it (EXPORT_MARKER) or overwrite; never a file."""
    out, ck = Path(out), Path(ckpt).resolve()
    res = out.resolve()
    protected = [ck]
    if ck.parent.name == "ckpt" or (ck.parent / "latest").exists():  # ck is <run>/ckpt/step_N
        run = ck.parent.parent
        protected += [ck.parent, *(run / n for n in RUN_FILES if (run / n).exists())]
    if hit := next((p for p in protected if _overlaps(res, p)), None):
        raise ExportError(
            f"--out {out} would replace {hit}, part of the checkpoint being exported ({ckpt}): choose another --out "
            "(the default is <run>/export-<engine>)"
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite and not _written_by_export(out):
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ExportError(
            f"--out {out} holds files export did not write ({shown}; no {EXPORT_MARKER}): "
            "choose another --out, or pass --overwrite to replace the whole directory"
        )


def _write(out, cfg: dict, sd: dict, provenance: dict) -> Path:
    """out (checked by check_export_out) written through a temporary dir beside it, then swapped in."""
    out = Path(out)
    tmp = None
    cfg["nanospec_export"] = {**provenance, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}  # ignored by the engines
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))  # never a user's name
        (tmp / EXPORT_MARKER).write_text("written by nanospec export.py; export --out replaces this directory\n")
        save_file(sd, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"--out {out}: cannot write the serving dir there ({os_why(e)})") from None
    return out


def vllm_method(family: str) -> tuple[str, dict]:
    """vLLM's speculative_config method (+ extra settings) that serves a draft family."""
    serving = FAMILIES[family].serving if family in FAMILIES else None
    if serving is None or "vllm" not in serving.engines:
        raise ExportError(f"vLLM has no loader for {family!r} drafts")
    return serving.vllm_method, dict(serving.vllm_extra)


def _target_embeddings(target_dir) -> torch.Tensor:
    if not target_dir:
        raise ExportError("--with-embeddings needs the target dir (the checkpoint names none; pass --target)")
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in (
                "model.embed_tokens.weight",
                "embed_tokens.weight",
                "model.language_model.embed_tokens.weight",
            ):
                if name in st.keys():
                    return st.get_tensor(name)
    raise ExportError(f"no embed_tokens weight found in {target_dir}/*.safetensors")


def _owner(cfg: dict, foreign: bool = False) -> Family | None:
    """The family whose layout a config.json in the engines' format holds (foreign: among the layouts
    whose dirs other trainers write too), or None."""
    return next(
        (f for f in FAMILIES.values() if f.serving and (f.serving.foreign or not foreign) and f.serving.owns(cfg)),
        None,
    )


def _architectures(foreign: bool = False) -> list[str]:
    """The architectures of the layouts read here (foreign: of those other trainers write too)."""
    served = [f.serving for f in FAMILIES.values() if f.serving and (f.serving.foreign or not foreign)]
    return list(dict.fromkeys(s.architecture for s in served))


def _read_serving(cfg: dict, engine: str | None, where: str) -> tuple[Family, object]:
    f = _owner(cfg)
    if f is None:
        raise ExportError(
            f"{where}: architectures {cfg.get('architectures')} is not a draft read here "
            f"(known: {', '.join(_architectures())})"
        )
    return f, f.config_cls(**f.serving.read(cfg, engine))


def config_from_serving(cfg: dict, engine: str | None = None):
    """An exported config.json (the engines' format) -> the draft config of the family it holds. The engine
    (which fixes how engine-dependent aux ids read) comes from the provenance block, else must be given."""
    return _read_serving(cfg, engine, "serving config")[1]


def load_exported(path: str | Path, engine: str | None = None) -> tuple[torch.nn.Module, dict]:
    """A serving dir -> (fp32 draft, its config.json)."""
    p = Path(path)
    if not (p / "config.json").exists() or not (p / "model.safetensors").exists():
        raise ExportError(f"{p}: not a serving dir (needs config.json and model.safetensors)")
    cfg = read_json(p / "config.json")
    if "speculators_config" in cfg:
        return read_draft(p, "speculators")[0], cfg
    f, c = _read_serving(cfg, engine, str(p))
    return _draft_from(f, read_tensors(p / "model.safetensors"), c, str(p / "model.safetensors")), cfg


def open_draft(path: str | Path) -> tuple[torch.nn.Module, dict]:
    """Any draft dir (training checkpoint, run dir or serving dir) -> (fp32 draft, what was
    recorded with it: "target" dir (or None), and for exports "tokenizer", see target_mismatch)."""
    p = Path(path)
    if (p / "model.safetensors").exists():
        draft, cfg = load_exported(p)
        return draft, cfg.get("nanospec_export", {})
    draft, meta = load_checkpoint(p)
    return draft, meta


def resolve_dir(target) -> Path:
    try:
        return resolve_target(str(target))
    except (FileNotFoundError, TargetError) as e:
        raise ExportError(f"target {target}: {e}") from None


# ---- the speculators format (vLLM's own trainer; vLLM 0.32 loads it natively) ----
# the decoder-layer fields that go into transformer_layer_config (the base of the config vLLM builds)
LAYER_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    *ROPE_FIELDS,
    "torch_dtype",
    "dtype",
)


def _verifier(target_dir) -> dict:
    """speculators_config.verifier: `vllm serve DRAFT` serves the draft on this target (its name_or_path)."""
    if not target_dir:
        raise ExportError("the speculators format names its target (verifier): pass --target")
    d = resolve_dir(target_dir).resolve()
    return {"name_or_path": str(d), "architectures": read_json(d / "config.json").get("architectures") or []}


def speculators_config(cfg: dict, c, serving, verifier: dict) -> dict:
    """Our vLLM-format config.json -> the speculators one (same tensors, some renamed by the layout). What
    vLLM 0.32's algos.py reads back: transformer_layer_config is the base of the draft's config, the
    family's fields (`serving.to_speculators`) complete it, and the method and K come from
    speculators_config."""
    name, arch = serving.speculators
    fields = serving.to_speculators(c)  # first: it refuses what speculators' reader would drop
    spec = {
        "architectures": [arch],
        "speculators_model_type": name,
        "transformer_layer_config": {k: cfg[k] for k in LAYER_FIELDS if k in cfg},
        "speculators_config": {
            "algorithm": name,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": serving.speculative_tokens(c),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "draft_vocab_size": cfg.get("draft_vocab_size", c.vocab_size),
        "target_hidden_size": c.target_hidden_size,
    }
    spec.update(fields)
    return spec


def config_from_speculators(spec: dict, num_layers: int | None, where: str) -> tuple[Family, object]:
    """A speculators config.json -> (the family, our draft config). `num_layers` (the target's) gives vLLM's
    default aux ids (2, L//2, L-3) when the config names none."""
    name = spec.get("speculators_model_type")
    known = {f.serving.speculators[0]: f for f in FAMILIES.values() if f.serving and f.serving.speculators[0]}
    if name not in known:
        raise ExportError(f"{where}: speculators_model_type {name!r} is not read here (known: {', '.join(known)})")
    f = known[name]
    try:
        cfg = dict(spec["transformer_layer_config"])
        k = spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        return f, f.config_cls(**f.serving.read(f.serving.from_speculators(spec, cfg, k, num_layers, where)))
    except (KeyError, IndexError, TypeError) as e:
        raise ExportError(f"{where}: not a speculators config (lacks {e})") from None


# ---- import: a draft made elsewhere -> our training checkpoint ----
IMPORT_FORMATS = ("auto", "speculators", "safeailab", "specforge")


def read_weights(d: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """model.safetensors or pytorch_model.bin (the EAGLE repo's) of a draft dir, and the file read."""
    if (d / "model.safetensors").exists():
        return read_tensors(d / "model.safetensors"), d / "model.safetensors"
    f = d / "pytorch_model.bin"
    if f.exists():
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ExportError(f"{f} is damaged or unreadable ({type(e).__name__}: {str(e)[:200]})") from None
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise ExportError(f"{f} is not a state dict of tensors")
        return sd, f
    if any(d.glob("*.index.json")):
        raise ExportError(f"{d}: sharded weights are not read here (merge them into one model.safetensors)")
    raise ExportError(f"{d}: no model.safetensors or pytorch_model.bin")


def _target_layers(target) -> int | None:
    """The target's layer count, or None where it is not at hand (e.g. a hub name in a speculators config)."""
    try:
        tc = read_json(resolve_dir(target) / "config.json") if target else {}
    except ExportError:
        return None
    return tc.get("text_config", tc).get("num_hidden_layers")


def import_draft(
    src: str | Path, out: str | Path, fmt: str = "auto", target: str | None = None, overwrite: bool = False
) -> Path:
    """A speculators, SafeAILab EAGLE-3, SpecForge EAGLE-3 or nanospec serving dir -> a training checkpoint
    out/ckpt/step_0/{draft.safetensors, config.json} + out/ckpt/latest (what load_checkpoint, evaluate.py
    and gate.py read); returns the step dir. Tensors keep their values (fp32 in, fp32 out: bit for bit).
    An `out` holding a run (a trained one's ckpt/latest would silently name the import) is refused unless
    overwrite, which deletes that run's files first, as train.py --overwrite does."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a directory")
    if old := previous_run(out):
        src_r = Path(src).resolve()
        if hit := next(
            (out / n for n in RUN_FILES if (out / n).exists() and _overlaps(src_r, (out / n).resolve())), None
        ):
            raise ExportError(f"--out {out}: the draft to import ({src}) is in its {hit.name}: choose another --out")
        if not overwrite:
            raise ExportError(
                f"--out {out} holds a run ({', '.join(old)}): choose another --out, or pass --overwrite to replace it "
                "(its checkpoints and metrics are deleted)"
            )
    draft, found = read_draft(src, fmt, target)
    meta = {
        "strategy": draft.family,
        "draft": draft.config.to_dict(),
        "target": found["target"],
        "imported_from": {"format": found["format"], "path": str(Path(src).resolve())},
    }
    try:
        clear_previous_run(out)
        return write_checkpoint(out / "ckpt", "step_0", draft.state_dict(), meta)  # no train_state.pt
    except OSError as e:
        raise ExportError(f"--out {out}: cannot write the checkpoint there ({os_why(e)})") from None


# the other trainers whose dirs a layout reads (Serving.foreign) -> the engine whose aux-id convention
# their explicit ids follow
FOREIGN = {"safeailab": "vllm", "specforge": "sglang"}


def read_draft(src: str | Path, fmt: str = "auto", target: str | None = None) -> tuple[torch.nn.Module, dict]:
    """A draft dir in any format read here -> (fp32 draft, {"format", "target": given, else recorded})."""
    p = Path(src)
    if fmt not in IMPORT_FORMATS:
        raise ExportError(f"unknown import format {fmt!r}: choose one of {IMPORT_FORMATS}")
    if not (p / "config.json").exists():
        raise ExportError(f"{p}: config.json is missing (not a draft dir)")
    cfg = read_json(p / "config.json")
    owner = _owner(cfg, foreign=True)
    named = owner.serving.named_ids(cfg) if owner else None
    if fmt == "auto":
        if "speculators_config" in cfg:
            fmt = "speculators"
        elif "nanospec_export" in cfg:
            fmt = "nanospec"
        elif owner and named:
            raise ExportError(
                f"{p / 'config.json'}: explicit {owner.serving.ids_key} {named}, read differently by "
                "vLLM and SGLang: pass --import-from safeailab (vLLM ids) or specforge (SGLang ids)"
            )
        elif owner:
            fmt = "safeailab"  # no ids: SpecForge's dir reads the same (the engines' default layers)
        else:
            raise ExportError(
                f"{p / 'config.json'}: not a draft format read here (no speculators_config, architectures "
                f"{cfg.get('architectures')}): pass --import-from {'|'.join(IMPORT_FORMATS[1:])}"
            )
    where = str(p / "config.json")
    recorded = None
    if fmt == "nanospec":
        draft, cfg = load_exported(p)
        sd, recorded = draft.state_dict(), cfg.get("nanospec_export", {}).get("target")
    else:
        sd, wfile = read_weights(p)
        if fmt == "speculators":
            recorded = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
            f, c = config_from_speculators(cfg, _target_layers(target or recorded), where)
            ours, theirs = f.serving.speculators_names
            sd = {k.replace(theirs, ours, 1) if ours else k: v for k, v in sd.items()}
        else:
            if owner is None:
                raise ExportError(
                    f"{where}: architectures {cfg.get('architectures')}, expected {_architectures(foreign=True)}"
                )
            f = owner
            engine = FOREIGN[fmt] if named else "vllm"
            c = f.config_cls(**f.serving.read(cfg, engine, where, num_layers=lambda: _target_layers(target)))
        sd = {k: v for k, v in sd.items() if not k.startswith("verifier_")}  # speculators' frozen verifier copies
        if "embed_tokens.weight" in sd:  # our drafts share the target's: the same values or refused
            own, ref = sd.pop("embed_tokens.weight"), target or recorded
            if (
                ref
                and _target_layers(ref) is not None
                and not torch.equal(own.float(), _target_embeddings(resolve_dir(ref)).float())
            ):
                raise ExportError(
                    f"{wfile}: embed_tokens.weight differs from the target's (our drafts share the target's)"
                )
        draft = _draft_from(f, sd, c, str(wfile))
    return draft.eval(), {"format": fmt, "target": target or recorded}


@dataclass
class ExportArgs:
    ckpt: tyro.conf.Positional[str]
    """training checkpoint dir (ckpt/step_N), or a run dir (its latest checkpoint)"""
    out: str = ""
    """serving dir to write (default: <run>/export-<engine>)"""
    engine: Literal["vllm", "sglang", "speculators"] = "vllm"
    """whose config format and aux-layer-id convention is written (the tensors are the same; speculators:
    the config.json of vLLM's own trainer, which `vllm serve DIR` loads without a speculative config)"""
    dtype: Literal["bf16", "fp32", "fp16"] = "bf16"
    with_embeddings: bool = False
    """also write embed_tokens.weight (the target's); engines share the target's otherwise"""
    target: str = ""
    """target dir (default: the one recorded in the checkpoint)"""
    import_from: Literal["", "auto", "speculators", "safeailab", "specforge"] = ""
    """the other way: read the draft dir CKPT (speculators, SafeAILab EAGLE-3 or SpecForge EAGLE-3; auto
    tells them apart) into a training checkpoint at --out (evaluate.py and gate.py read it)"""
    overwrite: bool = False
    """replace an --out that export did not write (export: a dir without its .nanospec-export marker; import: a
    run, whose checkpoints and metrics are deleted). Never the checkpoint being exported or its run"""


def main(a: ExportArgs) -> Path:
    """Every expected failure (ExportError, a missing file) is one `error: ...` line and exit 1."""
    if a.import_from:
        if not a.out:
            raise SystemExit("error: import failed: pass --out (the run dir to write)")
        try:
            path = import_draft(a.ckpt, a.out, a.import_from, a.target or None, a.overwrite)
        except (ExportError, FileNotFoundError) as e:
            raise SystemExit(f"error: import failed: {e}") from None
        print(
            f"[import] {a.ckpt} -> {path} ({json.loads((path / 'config.json').read_text())['imported_from']['format']})"
        )
        return path
    try:
        d = find_checkpoint(a.ckpt)
        out = a.out or str(d.parent.parent / f"export-{a.engine}")
        path = export(d, out, a.engine, a.dtype, a.with_embeddings, a.target or None, a.overwrite)
    except (ExportError, FileNotFoundError) as e:
        raise SystemExit(f"error: export failed: {e}") from None
    print(f"[export] {d} -> {path} ({a.engine}, {a.dtype}{', with embeddings' if a.with_embeddings else ''})")
    cfg = json.loads((path / "config.json").read_text())
    if a.engine == "sglang" and (cfg.get("fc_norm") or cfg.get("norm_output")):
        # SGLang's llama_eagle3 loader skips tensors it has no parameter for: one without EAGLE-3.1 support
        # serves this draft without its norms (lower acceptance, no error), so say so where the user looks
        print(
            "[export] note: an EAGLE-3.1 draft (fc_norm / norm_output): serve it with an SGLang that reads those "
            "fields; an older one loads it without the norms and says nothing"
        )
    return path


if __name__ == "__main__":
    main(tyro.cli(ExportArgs))
