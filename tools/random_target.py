"""Write a random-weight target directory from a preset, for throughput runs of train.py itself
(multi-GPU tables) where no real 8B / 30B checkpoint is on the machine.

    python tools/random_target.py llama-3.1-8b /tmp/llama8b            # on a GPU: ~1 min, 16 GB
    python tools/random_target.py qwen3-30b-a3b /tmp/qwen30b --device cuda
    torchrun --nproc_per_node=8 train.py --target /tmp/llama8b --backend compiled ...

The directory holds config.json (the preset's HF fields), model-XXXXX.safetensors shards (the
compiled backend's names: experts stacked as transformers 5 lays them out; `--backend compiled`
reads them) with model.safetensors.index.json, so that transformers loads them too (the
disaggregated producer's HF target, the consumer's embeddings and lm_head), and a tokenizer with a chat template
(SmolLM2's, whose ids all fit the presets' vocabularies: 49,152 < 128,256 / 151,936). Weights are
N(0, 0.02), norms 1, biases 0, as FastTarget.from_config draws them; --seed fixes them.

--no-weights writes config.json and the tokenizer only, and the compiled backend draws the weights on the GPU
when it loads the directory (FastTarget.from_pretrained): the Qwen3-30B-A3B shape is 61 GB of weights, about the
whole disk of the GPU machine. Nothing else reads such a directory (transformers, stored features' heads unless
--heads below): they say so.

    python tools/random_target.py qwen3-30b-a3b /tmp/qwen30b --no-weights   # seconds, a few MB

--no-weights --heads adds model.safetensors with the embeddings, the final norm and the lm_head alone (1.2 GB for
Qwen3-30B-A3B): what training from stored features and speculators' offline trainer read from a target (the offline
anchor, experiments/speculators_anchor.py --heads-only). FastTarget.from_pretrained then draws the rest and takes
these from the file, so captured features and the heads agree; transformers still refuses the directory.
"""

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.fast_target import PRESETS, FastTarget, TargetConfig  # noqa: E402
from models.target import DEFAULT_TARGET, DRAWN_AT_LOAD, HEADS_FILE, resolve_target  # noqa: E402

SHARD_BYTES = 4 << 30


def write_random_target(
    config: dict,
    out: Path,
    tokenizer: str = DEFAULT_TARGET,
    device: str = "cpu",
    dtype=torch.bfloat16,
    seed: int = 0,
    weights: bool = True,
    heads: bool = False,
) -> Path:
    """Build the model on `device`, write it to `out` (through a temporary dir renamed into place). weights=False:
    config.json and the tokenizer only, the weights drawn by FastTarget.from_pretrained when it loads `out`;
    with heads=True also HEADS_FILE (write_heads)."""
    if heads and weights:
        raise ValueError("heads=True writes the heads of a target drawn at load: pass weights=False with it")
    from transformers import AutoTokenizer  # lazy: transformers (~1.5 s to import) stays out of --help

    tok = AutoTokenizer.from_pretrained(resolve_target(tokenizer))
    if len(tok) > config["vocab_size"]:
        raise ValueError(
            f"tokenizer {tokenizer!r} has {len(tok)} tokens, more than the preset's vocab_size {config['vocab_size']}"
        )
    if not tok.chat_template:
        raise ValueError(f"tokenizer {tokenizer!r} has no chat template; train.py needs one")
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if weights:
        write_weights(config, tmp, device, dtype, seed)
    elif heads:
        write_heads(config, tmp, device, dtype, seed)
    random = {"seed": seed, "tokenizer": tokenizer} | ({} if weights else {"weights": DRAWN_AT_LOAD})
    cfg = {**config, "torch_dtype": str(dtype).removeprefix("torch."), "nanospec_random": random}
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def write_weights(config: dict, tmp: Path, device: str, dtype, seed: int):
    """The random model's safetensors shards and their HF index into `tmp`."""
    # aux layer 0 + need_final: every layer is built (which aux layers a run reads is its own choice)
    model = FastTarget.from_config(TargetConfig.from_dict(config), [0], dtype=dtype, device=device, seed=seed)
    shard, size, n = {}, 0, 0
    weight_map, total = {}, 0  # the HF index: tensor name -> shard file

    def flush():
        nonlocal shard, size, n, total
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file({k: v.contiguous().cpu() for k, v in shard.items()}, tmp / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            total += size
            shard, size, n = {}, 0, n + 1

    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        shard[k] = v
        size += v.numel() * v.element_size()
        if size >= SHARD_BYTES:
            flush()
    flush()
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )


def write_heads(config: dict, tmp: Path, device: str, dtype, seed: int):
    """HEADS_FILE: the embeddings and lm_head N(0, 0.02), the final norm 1, under the checkpoint names (FastTarget's,
    transformers' and speculators' alike), drawn on their own (not the whole model's 61 GB to take three tensors)."""
    V, H = config["vocab_size"], config["hidden_size"]
    g = torch.Generator(device=device).manual_seed(seed)
    heads = {"model.embed_tokens.weight": torch.empty(V, H, device=device, dtype=dtype).normal_(0.0, 0.02, generator=g)}
    heads["model.norm.weight"] = torch.ones(H, device=device, dtype=dtype)
    if not config.get("tie_word_embeddings"):
        heads["lm_head.weight"] = torch.empty(V, H, device=device, dtype=dtype).normal_(0.0, 0.02, generator=g)
    save_file({k: v.cpu() for k, v in heads.items()}, tmp / HEADS_FILE, metadata={"format": "pt"})


@dataclasses.dataclass
class Args:
    preset: Annotated[
        tyro.conf.Positional[str],
        tyro.conf.arg(metavar="PRESET", help=f"one of {', '.join(PRESETS)}, or a config.json path"),
    ]
    out: Annotated[tyro.conf.Positional[Path], tyro.conf.arg(metavar="OUT")]
    """the target directory to write"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """where the weights are drawn (default: cuda where there is one)"""
    dtype: Literal["bf16", "fp32"] = "bf16"
    seed: int = 0
    tokenizer: str = DEFAULT_TARGET
    """model dir / .gguf / 'smollm2' whose tokenizer is copied"""
    weights: bool = True
    """--no-weights: no weight files; the compiled backend draws them when it loads the directory"""
    heads: bool = False
    """with --no-weights: the embeddings, final norm and lm_head in model.safetensors (stored features' training
    and speculators' trainer read them); the compiled backend draws the rest"""


def main(a: Args):
    config = PRESETS[a.preset] if a.preset in PRESETS else json.loads(Path(a.preset).read_text())
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    try:
        out = write_random_target(dict(config), a.out, a.tokenizer, a.device, dtype, a.seed, a.weights, a.heads)
    except ValueError as e:  # the options or the tokenizer do not fit the preset: one line, no traceback
        raise SystemExit(f"error: {e}") from None
    gib = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**30
    drawn = f"heads only ({gib:.1f} GiB), the rest" if a.heads else "no weights:"
    print(f"wrote {out} ({f'{gib:.1f} GiB' if a.weights else f'{drawn} drawn at load by --backend compiled'})")


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
