"""Tensor parallelism of the compiled target backend (FastTarget.parallelize) with two gloo ranks
on CPU, real processes: TP=2 hidden states (aux layers and final normed) equal the single-rank
backend's on tiny random Llama (GQA, llama3 rope), Qwen3 (q/k norm, q/k/v/o biases) and Qwen3-MoE
(mixed dense/sparse layers; grouped GEMM and padded-bmm experts) models, for whole rows (SDPA),
padded rows and packed documents (flex document mask), and are bit-identical on both ranks;
head counts tp does not divide fail clearly; train.py --backend compiled --tp 2 on two ranks
trains exactly like one rank."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from data.chat import Example
from data.packing import pack
from models.fast_target import FastTarget, TargetConfig
from tests.test_train_e2e import run_train, train_rows
from tests.tiny import LLAMA3_SHORT_ROPE, TINY_TARGET_SHAPE

TOL = dict(rtol=1e-5, atol=1e-5)  # atol scaled by the reference's largest value, as in test_fast_target

COMMON = dict(TINY_TARGET_SHAPE, num_hidden_layers=4, rms_norm_eps=1e-6)
CONFIGS = {
    "llama": dict(COMMON, model_type="llama", rope_theta=10000.0, rope_scaling=dict(LLAMA3_SHORT_ROPE)),
    "qwen3_bias": dict(
        COMMON, model_type="qwen3", rope_theta=1e6, attention_bias=True
    ),  # q/k norm, o bias (row-parallel)
    "qwen3_moe": dict(
        COMMON,
        model_type="qwen3_moe",
        rope_theta=1e6,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    ),
}
AUX = [0, 1, 2]


def random_target(d: dict, seed=0, dtype=torch.float32, device="cpu") -> FastTarget:
    """Large random weights (std 0.02 is nearly the identity), the same on every rank."""
    fast = FastTarget.from_config(TargetConfig.from_dict(d), AUX, dtype=dtype, device=device, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in fast.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn(p.shape, generator=g)
                if n.endswith("norm.weight")
                else 0.15 * torch.randn(p.shape, generator=g)
            )
    return fast


def batches(vocab: int) -> dict:
    """name -> (forward kwargs, [(row, start, length)] of valid tokens)."""
    g = torch.Generator().manual_seed(1)
    lengths = [29, 17, 6]
    T = max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(0, vocab, (len(lengths), T), generator=g) * mask
    docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (19, 33, 7, 25, 11)]
    packed = pack([Example(d, [1] * len(d)) for d in docs], row_len=40)
    return {
        "whole": (dict(input_ids=ids[:2]), [(b, 0, T) for b in range(2)]),
        "padded": (dict(input_ids=ids, attention_mask=mask), [(b, 0, n) for b, n in enumerate(lengths)]),
        "packed": (
            dict(input_ids=packed["input_ids"], doc_ids=packed["doc_ids"]),
            [(r, s, len(d)) for (r, s), d in zip(packed["where"].tolist(), docs)],
        ),
    }


def max_rel_err(f, ref, spans) -> float:
    """Largest |tp - single| over valid tokens, relative to the reference's largest value."""
    err = 0.0
    for which in ("aux_hidden", "final_hidden"):
        a, b = getattr(f, which).float(), getattr(ref, which).float()
        for r, s, n in spans:
            err = max(
                err, ((a[r, s : s + n] - b[r, s : s + n]).abs().max() / b[r, s : s + n].abs().max().clamp(min=1)).item()
            )
    return err


def _worker(rank: int, world: int, store: str, out: str, cuda: bool = False):
    """CPU: gloo, fp32, eager. cuda: NCCL, one GPU per rank, bf16, compiled layers (the H200 path);
    there err_single is the single-rank bf16 model's own error against fp32, the scale for TP's."""
    torch.set_num_threads(1)
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cuda" if cuda else "cpu", (world,), mesh_dim_names=("tp",))
        res = {}
        for kind, d in CONFIGS.items():
            torch._dynamo.reset()  # a fresh recompile budget per model
            single = random_target(d, device=device)  # fp32: the reference
            tp = random_target(d, dtype=torch.bfloat16 if cuda else torch.float32, device=device).parallelize(mesh)
            local_heads = tp.model.layers[0].self_attn.q_proj.weight.shape[0] // d["head_dim"]
            assert local_heads == d["num_attention_heads"] // world, local_heads
            if cuda:
                single_bf16 = random_target(d, dtype=torch.bfloat16, device=device).compile_layers(dynamic=None)
                tp.compile_layers(dynamic=None)
            # experts on CPU: grouped GEMM, then the padded-bmm fallback (on GPU in bf16: grouped GEMM)
            paths = [True, False] if kind == "qwen3_moe" and not cuda else [None]
            for grouped in paths:
                for m in (*single.modules(), *tp.modules()):
                    if grouped is not None and hasattr(m, "use_grouped_mm"):
                        m.use_grouped_mm = grouped and hasattr(torch, "_grouped_mm")
                for name, (kw, spans) in batches(d["vocab_size"]).items():
                    kw = {k: v.to(device) for k, v in kw.items()}
                    f, ref = tp(**kw), single(**kw)
                    assert (
                        type(f.aux_hidden) is torch.Tensor and type(f.final_hidden) is torch.Tensor
                    )  # plain, not DTensor
                    gathered = [torch.empty_like(f.final_hidden) for _ in range(world)]
                    dist.all_gather(gathered, f.final_hidden.contiguous())
                    key = f"{kind}{'' if grouped is None else '_grouped' if grouped else '_bmm'}/{name}"
                    res[key] = dict(
                        err=max_rel_err(f, ref, spans), same_on_ranks=all(torch.equal(g, gathered[0]) for g in gathered)
                    )
                    if cuda:
                        res[key]["err_single"] = max_rel_err(single_bf16(**kw), ref, spans)
        try:  # 1 KV head cannot be split over 2 ranks
            random_target(dict(CONFIGS["llama"], num_key_value_heads=1)).parallelize(mesh)
            res["bad"] = "no error"
        except ValueError as e:
            res["bad"] = str(e)
        if rank == 0:
            with open(out, "w") as fh:
                json.dump(res, fh)
    finally:
        dist.destroy_process_group()


def spawn_tp2(tmp, cuda=False) -> dict:
    out = tmp / "results.json"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, str(tmp / "store"), str(out), cuda), nprocs=2, join=True)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    """One spawn of two gloo ranks runs every case (process start-up dominates on 2 cores)."""
    return spawn_tp2(tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("kind", ["llama", "qwen3_bias", "qwen3_moe_grouped", "qwen3_moe_bmm"])
@pytest.mark.parametrize("batch", ["whole", "padded", "packed"])
def test_tp2_hidden_states_equal_single_rank(tp2_results, kind, batch):
    if kind == "qwen3_moe_grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing")
    r = tp2_results[f"{kind}/{batch}"]
    assert r["err"] <= TOL["atol"], r
    assert r["same_on_ranks"], "ranks disagree: outputs are not replicated"


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_nccl_bf16_compiled(tmp_path):
    """Two GPUs, NCCL, bf16, compiled layers: TP's error against the fp32 single-rank model stays
    within twice the single-rank bf16 model's own (a wrong split errs by O(1))."""
    res = spawn_tp2(tmp_path, cuda=True)
    for key, r in res.items():
        if key != "bad":
            assert r["err"] <= 2 * r["err_single"] + 1e-3 and r["same_on_ranks"], (key, r)


def test_indivisible_heads_fail_clearly(tp2_results):
    msg = tp2_results["bad"]
    assert "tensor parallel size 2 must divide num_key_value_heads=1" in msg, msg


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_train_tp2_matches_one_rank(tmp_path, tiny_run_inputs, compiled):
    """train.py: 2 ranks as one TP=2 group (dp=1) see the one global batch; the draft (FSDP over
    both ranks) must train exactly as on one rank with the unsplit target; also with the draft step
    compiled on both sides (--compile, ~4 min on 2 cores)."""
    target, data = tiny_run_inputs
    # --max-len 128: the chats' first assistant tokens start past 64, and a batch without any trains nothing
    extra = [
        "--steps",
        "2",
        "--backend",
        "compiled",
        "--num-records",
        "24",
        "--max-len",
        "128",
        "--eval-batch-size",
        "4",
        *(["--compile"] if compiled else []),
    ]
    run_train(tmp_path / "one", target, data, 1, extra)
    p = run_train(tmp_path / "tp2", target, data, 2, [*extra, "--tp", "2"])
    assert "[target] tensor parallel over 2 ranks, 1 data-parallel group(s)" in p.stdout
    one, two = train_rows(tmp_path / "one"), train_rows(tmp_path / "tp2")
    assert len(one) == len(two) == 2 and all(r["loss"] > 0 for r in one)
    for a, b in zip(one, two):
        for k in ("loss", "loss_0", "acc_0", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)
    if not compiled:
        p = run_train(tmp_path / "bad", target, data, 0, [*extra, "--tp", "2"], check=False)  # one process: world 1
        assert p.returncode != 0 and "--tp 2 must divide the number of ranks (1)" in p.stdout + p.stderr
