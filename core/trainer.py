"""The training loop behind train.py: Trainer (the target and the draft loaded, the step, evaluation, the loop with
its logging, stops and run.json / metrics.jsonl) and the exit statuses a run ends with. Data feeding is
core/feeding.py's, checkpoints and resume core/checkpoint.py's. Library code: train.py runs it from the command
line, core/disagg/roles.py subclasses it for a consumer and experiments/loop_acc.py evaluates with it, none of them
importing the entry script."""

import dataclasses
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

import core.checkpoint as checkpoint
from core.disagg.roles import consumer_target
from core.distributed import all_sum, barrier, init_distributed
from core.features import BACKENDS, host_features, load_target, open_for_training, pick_backend
from core.feeding import Batcher, batching, gpu_memory, load_data, packing
from core.optim import MuonAdamW, lr_at, muon_groups
from core.runlog import (
    Heartbeat,
    RunLog,
    StopRequest,
    Throughput,
    clear_previous_run,
    compiled_graphs,
    peak_flops,
    process_seconds,
    run_metadata,
)
from core.train_config import ConfigError, TrainConfig, auto_compile, validate
from core.vllm_features import vllm_target
from data.prefetch import Prefetcher
from data.vocab import count_tokens
from models.families import FAMILIES
from models.layers import param_count
from models.moe import MoESizeError
from models.target import Features, TargetHeads, config_int, load_tokenizer, past_context, resolve_target

# The exit status of a run stopped early with a checkpoint (a first SIGTERM or Ctrl-C, --time-limit): not
# finished, `--resume` continues it. 75 is sysexits.h's EX_TEMPFAIL ("try again later"), apart from 0
# (finished, or stopped after --stop-after steps as asked) and 1 (failed: an `error:` line or a traceback).
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130  # Ctrl-C before training started, or a second one: no checkpoint of this invocation
QUIET_S = 60.0  # a run with no step or evaluation batch done for this long says so (runlog.Heartbeat)


def torch_older_than(major: int, minor: int) -> bool:
    """torch.__version__ ("2.11.0+cu130") before major.minor."""
    v = torch.__version__.split("+")[0].split(".")
    return (int(v[0]), int(v[1])) < (major, minor)


def target_matmul_params(t) -> int:
    """The target's parameters one token is multiplied by in a forward (MFU's 2 * N_target): all of them but the
    embedding (a lookup; a tied lm_head is a matmul all the same), and of an MoE layer's stacked experts
    ([E, ...] tensors under `experts.`, the layout of transformers 5 and models/fast_target.py) only the
    num_experts_per_tok of E a token is routed to. Counting every expert put a Qwen3-30B-A3B run's MFU at 2.26
    (2026-12-07, H200): ~30B parameters where a token runs ~3.0B besides the embedding."""
    c = t.config
    E = getattr(c, "num_experts", 0) or getattr(c, "num_local_experts", 0) or 0
    k = getattr(c, "num_experts_per_tok", 0) or 0
    n = 0
    for name, p in t.named_parameters():
        routed = E and k and ".experts." in f".{name}" and p.dim() == 3 and p.shape[0] == E
        n += p.numel() * k // E if routed else p.numel()
    embed, head = t.embed_tokens.weight, t.lm_head.weight
    return n - embed.numel() + (head.numel() if head is embed else 0)


class Trainer:
    def __init__(self, cfg: TrainConfig):
        validate(cfg)
        self.family = FAMILIES[cfg.strategy]
        if cfg.objective == "auto":
            cfg = dataclasses.replace(cfg, objective=self.family.objectives[0])
        if cfg.objective not in self.family.objectives:
            raise ConfigError(
                f"--objective {cfg.objective!r} is not one of {cfg.strategy}'s: {', '.join(self.family.objectives)}"
            )
        if cfg.compile and cfg.objective.startswith("lk"):
            raise ConfigError(
                "--compile with the LK objectives is untested "
                "(their batch-mean acceptance is all-reduced inside the step)"
            )
        if cfg.device not in ("auto", "cpu", "cuda"):  # anything else ran on the CPU without a word
            raise ConfigError(f"--device must be auto, cpu or cuda, got {cfg.device!r}")
        kind = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        auto = self.family.auto(kind)
        cfg = dataclasses.replace(cfg, **{k: v for k, v in auto.items() if getattr(cfg, k) == "auto"})
        if kind == "cpu" and cfg.attention.startswith("flex"):
            raise ConfigError(
                "--attention flex has no backward on CPU (torch raises NotImplementedError); use lse or eager"
            )
        if kind == "cpu" and cfg.compile and cfg.objective in ("tv", "rkl", "jsd") and torch_older_than(2, 13):
            # tests/test_draft_step.py's compiled JSD step on CPU under torch 2.11 (2026-12-05, an H100 machine's
            # CPU: experiments/results/cuda_tests_h100_draft_step.txt): the eager loss, other gradients
            raise ConfigError(
                f"--compile with --objective {cfg.objective} on CPU needs torch >= 2.13 (this is {torch.__version__}):"
                " torch 2.11's inductor compiled the jsd step with wrong gradients (tv and rkl, the same ops, are"
                " untested there); drop --compile"
            )
        if kind == "cpu" and cfg.gpu_memory:
            raise ConfigError(f"--gpu-memory {cfg.gpu_memory:g} caps a GPU's memory, and this run is on the CPU")
        if cfg.backend not in ("auto", *BACKENDS):
            raise ConfigError(f"--backend must be auto or one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
        self.cfg = cfg
        self.rank, self.world, local = init_distributed(kind)
        self.device = torch.device(kind, local) if kind == "cuda" else torch.device("cpu")
        if kind == "cuda":
            torch.cuda.set_device(self.device)
        # the bytes the run may use: the GPU's, or --gpu-memory's with the allocator capped before anything loads
        self.gpu_bytes = gpu_memory(cfg, self.device) if kind == "cuda" else 0
        # --tp: a (dp, tp) mesh, rank = d*tp + t. Ranks of one tp group (contiguous, so on one host's
        # NVLink) run the target on one batch together: data is split by dp rank, not rank. The draft
        # stays FSDP2 over the whole world: tp peers get identical batches, hence identical gradients,
        # and the global normalisers (summed over all ranks) and FSDP's world average count each tp-fold,
        # which cancels; one sharded copy cannot drift apart as dp-only replicas could under GPU
        # nondeterminism.
        self.dp_rank, self.dp_size, self.tp_mesh = self.rank, self.world, None
        if cfg.tp > 1:
            if self.world % cfg.tp or cfg.backend not in ("auto", "compiled") or cfg.features or cfg.deploy.role:
                raise ConfigError(
                    f"--tp {cfg.tp} must divide the number of ranks ({self.world}) and needs --backend compiled "
                    "with an online target (no --features, no disaggregated roles)"
                )
            from torch.distributed.device_mesh import init_device_mesh  # torchrun only: --tp > 1

            mesh = init_device_mesh(kind, (self.world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))
            self.tp_mesh, self.dp_rank, self.dp_size = mesh["tp"], mesh.get_local_rank("dp"), mesh.size(0)
        # bf16 on GPU; fp32 on CPU, where bf16 matmuls are emulated and ~30x slower
        self.dtype = torch.bfloat16 if kind == "cuda" else torch.float32
        torch.manual_seed(cfg.seed)
        self.out = Path(cfg.out)
        self.log = RunLog(self.out, enabled=self.rank == 0)
        self.schedule = 0.0  # fraction of training done (loss schedules, e.g. Domino's curriculum)
        # start-up's clock (seconds since the process started): where a cold start goes, in run.json and one line
        self.startup = {}
        target_dir, stored = self._load_target(kind)
        self.tick("target")
        cfg = self.cfg
        self.tokenizer = load_tokenizer(target_dir)
        self.pack = packing(cfg, self.family, self.target, kind, self.print)
        self.cfg = cfg = batching(
            cfg, kind, self.pack, self.target, self.device, self.gpu_bytes, self.dp_size, self.out, self.print
        )
        data = load_data(cfg, self.tokenizer, self.pack, self.store, stored, self.print, self.bar)
        self.train_set, self.eval_set, self.batches = data.train_set, data.eval_set, data.batches
        self.row_len, self.data_stats, self.total_steps = data.row_len, data.stats, cfg.steps or data.batches.per_epoch
        if why := auto_compile(cfg, kind, self.total_steps, self.world):
            self.print(f"[draft] compiling the draft step: {why}")
            self.cfg = cfg = dataclasses.replace(cfg, compile=True)
        self.tick("data")
        row_multiple = cfg.pack_row_multiple or (0 if kind == "cuda" else 1)  # 0: data/packing.bucket
        self.batcher = Batcher(
            cfg, self.family, self.device, self.pack, self.row_len, row_multiple, self.dp_rank, self.dp_size
        )
        self._build_draft()
        self.tick("draft")

    def tick(self, what: str):
        """Start-up's clock: `what` (target, data, draft, eval_start, first_step) done this many s after start."""
        self.startup[what] = round(process_seconds(), 1)

    def _load_target(self, kind: str) -> tuple[Path, list | None]:
        """The target (or, offline, the feature store and the target's heads) as --backend says, --backend auto
        settled in self.cfg; returns the target's directory and a store's examples (None online)."""
        cfg = self.cfg
        target_dir = resolve_target(cfg.target) if self.rank == 0 else None
        self.barrier()
        target_dir = resolve_target(cfg.target)
        if cfg.backend == "auto":
            backend, why = pick_backend(target_dir, kind)
            if why and not (cfg.features or cfg.deploy.role == "consumer"):  # else no target forward runs here
                self.print(f"[target] --backend hf: {why}")
            self.cfg = cfg = dataclasses.replace(cfg, backend=backend)
            if cfg.tp > 1 and backend == "hf":
                raise SystemExit(
                    f"--tp {cfg.tp} needs the compiled target: {why or 'hf on CPU'}; pass --backend compiled"
                )
        if not cfg.features and (why := past_context(target_dir, cfg.max_len, "--max-len")):  # (a store: its own)
            raise ConfigError(f"{why}: a longer conversation would run the target past it; pass a smaller --max-len")
        V = config_int(target_dir, "vocab_size")
        if "draft_vocab_size" in self.family.options and V and cfg.draft_vocab_size > V:
            raise ConfigError(
                f"--draft-vocab-size {cfg.draft_vocab_size} is larger than the target's vocabulary ({V} tokens in "
                f"{target_dir / 'config.json'}): the draft vocabulary is a subset of the target's"
            )
        self.store, stored = None, None
        if cfg.features:
            self.store, stored, self.target = open_for_training(
                cfg.features, target_dir, cfg.aux_layers, self.dtype, self.device
            )
        elif cfg.deploy.role == "consumer":  # disaggregated: the producers run the target (core/disagg/roles.py)
            self.target = consumer_target(target_dir, cfg.aux_layers, self.dtype, self.device)
        else:
            aux = list(cfg.aux_layers) or None
            self.target = load_target(
                cfg.backend, target_dir, aux, self.dtype, self.device, cfg.max_len, vllm_target, tp_mesh=self.tp_mesh
            )
            if self.tp_mesh is not None:
                self.print(
                    f"[target] tensor parallel over {self.tp_mesh.size()} ranks, {self.dp_size} data-parallel group(s)"
                )
        return target_dir, stored

    def barrier(self):
        barrier()

    def print(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    heartbeat: Heartbeat | None = None  # while train() runs

    def progress(self, what: str):
        """Something finished (a step, an evaluation batch): the heartbeat's quiet clock restarts."""
        if self.heartbeat is not None:
            self.heartbeat.mark(what)

    def bar(self, it, desc: str, total: int | None = None):
        """`it` with a progress bar on rank 0 (--progress), for the minutes before training's own bar."""
        if not (self.cfg.progress and self.rank == 0):
            return it
        return tqdm(it, desc=desc, total=total, dynamic_ncols=True, leave=False)

    def _build_draft(self):
        cfg, t = self.cfg, self.target
        counts = count_tokens(self.train_set, t.config.vocab_size)
        try:
            draft = self.family.build(cfg, t, counts, self.tokenizer)
        except MoESizeError as e:  # needs the target's MLP size: known only now
            raise ConfigError(f"--moe-experts {cfg.moe_experts} on this target: {e}") from None
        self.draft_config = draft.config
        if cfg.init_draft:
            checkpoint.init_from(draft, Path(cfg.init_draft), cfg.strategy, self.print)
        t2d = getattr(draft, "t2d", None)
        vocab = (
            ""
            if t2d is None
            else (
                f", draft vocab {int(t2d.sum())} covers "
                f"{counts[t2d].sum().item() / max(1, counts.sum().item()):.1%} of trained tokens"
            )
        )
        draft.to(self.device)
        self.print(f"[draft] {cfg.strategy}: {param_count(draft) / 1e6:.1f}M params{vocab}")
        if self.world > 1:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # torchrun only: world > 1

            mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
            # ZeRO-2 style: parameters stay gathered between forward and backward
            fully_shard(draft, reshard_after_forward=False, mp_policy=mp)
        elif self.dtype != torch.float32:
            draft.to(self.dtype)
        self.draft = draft
        # the training step compiled as a unit (the TTT unroll one graph: tests/test_draft_step.py); the Triton
        # CE stays eager after it (kernels/ce.py), evaluation eager.
        # Several ranks: the FSDP2 module is compiled; dynamo skips FSDP's unshard/reshard hooks (they run
        # eagerly around the one graph, no break), so the gathered parameters are plain inputs to it
        self.draft_step = torch.compile(draft, dynamic=None) if cfg.compile else draft
        if cfg.optimizer == "muon":
            self.opt = MuonAdamW(muon_groups(draft.named_parameters(), cfg.weight_decay), lr=cfg.lr)
        else:
            decay = [p for n, p in draft.named_parameters() if p.ndim >= 2]
            no_decay = [p for n, p in draft.named_parameters() if p.ndim < 2]
            self.opt = torch.optim.AdamW(
                [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                lr=cfg.lr,
                betas=(0.9, 0.95),
                eps=1e-8,
                fused=True if self.device.type == "cuda" and self.world == 1 else None,
            )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_at(s, cfg, self.total_steps))

    # ---- one batch -> the family's loss ----
    def with_features(self, host: dict) -> dict:
        """A host batch (Batcher.host_batch's) with, where the features are stored (--features, or a consumer's
        producers), its examples' aux_hidden / final_hidden added, padded to its rows (pinned on a GPU). On the
        prefetch thread this reading and checking of the store overlaps the previous step; it sat between steps
        on the main thread before, the GPU idle."""
        if self.store is not None:
            ids = host["input_ids"]
            host |= host_features(
                self.store,
                host["examples"],
                ids.shape[1],
                self.dtype,
                where=host.get("where"),
                n_rows=ids.shape[0],
                pin=self.device.type == "cuda",
            )
        return host

    def forward(
        self,
        examples,
        scale: float = 1.0,
        global_counts: bool = True,
        b: dict | None = None,
        key: int = 0,
        row_sizes: list[int] | None = None,
        rows: int | None = None,
    ):
        """Target features -> the family's batch -> its loss. With global_counts the per-position
        normalisers are summed over ranks first, so every rank's loss is a share of one
        global mean (scale=world undoes FSDP's gradient averaging). b: the batch of `examples`
        already built and on the device (the prefetcher's); else built here, row_sizes and rows as
        host_batch takes them (Batcher.eval_batches')."""
        if b is None:
            host = self.with_features(self.batcher.host_batch(examples, key, row_sizes=row_sizes, rows=rows))
            b = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in host.items()}
        if self.store is not None:
            feats = Features(aux_hidden=b["aux_hidden"], final_hidden=b["final_hidden"])
        elif "doc_ids" in b:  # packed rows: each document attends to itself only, positions restart
            feats = self.target(b["input_ids"], doc_ids=b["doc_ids"], position_ids=b["position_ids"])
        else:
            feats = self.target(b["input_ids"], b["attention_mask"] if b["padded"] else None)
        batch = self.family.make_batch(feats, b, self.target, self.draft)
        counts = self.family.counts(batch, self.draft, self.cfg)
        if global_counts:
            counts = all_sum(counts)
        draft = self.draft_step if torch.is_grad_enabled() else self.draft
        loss, stats = self.family.step(draft, batch, counts, self.cfg, b, self.schedule)
        return loss * scale, stats, counts, b["ntok"]

    def metrics(self, stats, counts) -> dict:
        loss_sum, correct = all_sum(stats["loss_sum"].clone()), all_sum(stats["correct"].clone().float())
        out = {}
        for k in range(self.cfg.ttt_length):
            out[f"loss_{k}"] = (loss_sum[k] / counts[k, 1].clamp(min=1)).item()
            out[f"acc_{k}"] = (correct[k] / counts[k, 0].clamp(min=1)).item()
        return out

    def evaluate(self) -> dict:
        """Held-out acc_k / loss_k over all ranks (each takes every world-th batch)."""
        K = self.cfg.ttt_length
        tot_loss, tot_correct, tot_counts = torch.zeros(K), torch.zeros(K), torch.zeros(K, 2)
        batches = self.batcher.eval_batches(self.eval_set, self.batches)
        rows = self.batcher.evaluate_rows(self.batches)
        # With autograd on where the batches have the training step's shape (one rank): flex and the compiled
        # draft step compile per grad mode, so a no_grad evaluation compiled graphs of its own, 7 flex calls at
        # TTT 7 (~16 s of the main job's 107 s from a cold start on an H100: experiments/results/defaults_h100/).
        # Nothing runs backward; each batch's graph goes with its loss. Several ranks keep no_grad (FSDP2's
        # forward under autograd with no backward after it is untried).
        with torch.set_grad_enabled(rows is not None and self.world == 1):
            # every rank runs the same number of forwards (FSDP all-gathers are collectives); a rank
            # past the end reruns the first batch with weight 0
            n_iter = math.ceil(len(batches) / self.dp_size)
            for j in self.bar(range(n_iter), "eval"):
                self.progress(f"evaluation, {j} of {n_iter} batches done" if j else "evaluation started")
                i = j * self.dp_size + self.dp_rank
                w = float(i < len(batches))
                examples, row_sizes = batches[i if w else 0]
                loss, stats, counts, _ = self.forward(
                    examples, global_counts=False, key=-1 - j, row_sizes=row_sizes, rows=rows
                )
                del loss  # its graph (with autograd on) before the next batch's
                tot_loss += w * stats["loss_sum"].detach().float().cpu()
                tot_correct += w * stats["correct"].detach().float().cpu()
                tot_counts += w * counts.detach().float().cpu()
        for x in (tot_loss, tot_correct, tot_counts):
            all_sum(x)
        out = {}
        for k in range(K):
            out[f"acc_{k}"] = (tot_correct[k] / tot_counts[k, 0].clamp(min=1)).item()
            out[f"loss_{k}"] = (tot_loss[k] / tot_counts[k, 1].clamp(min=1)).item()
        return out

    # ---- checkpoints (core/checkpoint.py) ----
    def save(self, step: int):
        meta = {"strategy": self.cfg.strategy, "draft": self.draft_config.to_dict(), "target": str(self.target.path)}
        checkpoint.save(self.out, step, self.draft, self.opt, self.sched, meta, self.rank, self.world, self.device)

    def load(self) -> int:
        return checkpoint.restore(
            self.out, self.draft, self.opt, self.sched, self.rank, self.world, self.device, self.print
        )

    # ---- throughput ----
    def throughput(self) -> Throughput:
        """The run's token counter; MFU's model FLOPs per real token (runlog.Throughput says what they count),
        only for a family whose draft runs over every row token once per TTT step (EAGLE-3): the others' work per
        token (P-EAGLE's sampled rollouts, the block drafters' anchors) has no such simple count, so no MFU."""
        if not self.family.ttt_passes:
            return Throughput(None, self.world, None)
        K = self.cfg.ttt_length
        n_draft = param_count(self.draft)  # DTensor numel is the global size
        n_target = 0
        if not isinstance(
            self.target, TargetHeads
        ):  # a target forward runs here (not offline / a consumer of producers / --backend vllm: vLLM's process)
            n_target = target_matmul_params(self.target)
        return Throughput(6 * n_draft * K + 2 * n_target, self.world, peak_flops(self.device))

    def sync_device(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def global_token_sum(self, xs: list[int]) -> list[float]:
        """Token counts summed over data-parallel ranks (tp peers hold the same batch)."""
        t = all_sum(torch.tensor(xs, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu"))
        return (t / self.cfg.tp).tolist()

    def packing_summary(self, speed: Throughput) -> dict:
        """run.json: how full the rows of this invocation's training steps were."""
        real, rows = self.global_token_sum([speed.total_real, speed.total_rows])
        return {
            "packed": self.pack,
            "row_len": self.row_len,
            "real_tokens": int(real),
            "row_tokens": int(rows),
            "efficiency": real / max(rows, 1),
        }

    # ---- hooks (core/disagg/roles.py's consumer overrides them) ----
    def step_examples(self, step: int) -> list:
        """This rank's examples of optimizer step `step`."""
        return [self.train_set[i] for i in self.batches.indices(step, self.dp_rank, self.dp_size)]

    def after_step(self, step: int):
        """Called after each optimizer step."""

    # ---- the loop ----
    def train(self) -> dict:
        self.heartbeat = Heartbeat(QUIET_S, self.print)
        try:
            return self._train()
        finally:
            self.heartbeat.close()

    def _train(self) -> dict:
        cfg = self.cfg
        if cfg.overwrite and not cfg.resume and self.rank == 0 and (old := clear_previous_run(self.out)):
            self.print(f"[out] --overwrite: removed the previous run's {', '.join(old)} from {self.out}")
        start = self.load() if cfg.resume else 0
        meta = run_metadata(
            cfg,
            world=self.world,
            device=self.device,
            extra={"data": self.data_stats, "draft": self.draft_config.to_dict(), "target_dir": str(self.target.path)},
        )
        # rows of the checkpoint's step and before are the run's record; later ones were logged after it, before
        # a kill, and are logged again (the final evaluation only follows the last checkpoint: redone too)
        end = self.total_steps
        self.log.start(
            meta,
            resume=cfg.resume,
            resume_step=start,
            keep=lambda r: (
                r.get("step", 0) < start or (r.get("step") == start and not (start == end and r.get("split") == "eval"))
            ),
        )
        results = {}
        if not self.eval_set:  # accuracies over no examples would print as 0.000
            self.print("[eval] --holdout 0: no held-out examples, so no held-out evaluation")
        if start == 0 and self.eval_set and cfg.eval_at_start:
            results["eval_start"] = self.evaluate()
            self.print(f"[eval @0] {fmt(results['eval_start'])}")
            self.log.write({"step": 0, "split": "eval", **results["eval_start"]})
            self.tick("eval_start")
        bar = None
        if cfg.progress and self.rank == 0:
            bar = tqdm(total=self.total_steps, initial=start, desc="train", dynamic_ncols=True)
        # train_seconds counts every start's training: a resumed run adds this start's to the seconds its stopped
        # starts recorded (2026-12-07: a run resumed once reported only its last start's 111 s); a start killed
        # outright records nothing, and its steps after the last checkpoint are trained again anyway
        earlier = self.log.meta.get("results", {}).get("train_seconds", 0.0) if cfg.resume else 0.0
        t0 = time.time() - earlier  # train_seconds = now - t0
        speed = self.throughput()

        def examples_of(step):
            return self.with_features(self.batcher.step_batch(self.batches, step, self.step_examples(step)))

        # stored features are the bulk of an offline batch (8H bytes a token): one batch waits ready, not two
        depth = 1 if cfg.features or cfg.deploy.role == "consumer" else 2
        prefetch = Prefetcher(examples_of, range(start, self.total_steps), self.device, depth=depth)
        stop = StopRequest(cfg.time_limit, self.device, self.world)
        try:
            return self.loop(start, prefetch, stop, speed, bar, t0, results)
        finally:
            stop.close()

    def non_finite(self, step: int) -> FloatingPointError:
        """The error a non-finite loss stops the run with: where the last good checkpoint is, or that none is."""
        last = next(iter(checkpoint.checkpoints(self.out)), None)
        when = (
            ""
            if self.device.type == "cpu"
            else " at this step (on GPU the loss is checked at log/eval/checkpoint steps)"
        )
        return FloatingPointError(
            f"non-finite loss at step {step}; parameters were not updated{when}. "
            + (
                f"Last good checkpoint: {last} (continue from it with --resume and a lower --lr, or check the data)"
                if last
                else f"No checkpoint was saved before it ({self.out / 'ckpt'} has none; --ckpt-every N saves along the "
                "way): lower --lr or check the data, then rerun with --overwrite"
            )
        )

    def log_step(self, n: int, stats, counts, loss, gnorm, speed, bar):
        """metrics.jsonl's train row after step n (accuracies, loss over ranks, lr, grad norm, speed, compiled
        graphs: a count growing after warm-up means recompiles; on a GPU the peak allocated so far) and the
        progress bar's figures."""
        m = self.metrics(stats, counts)
        m.update(
            loss=(all_sum(loss.detach().clone()) / self.world).item(),
            lr=self.sched.get_last_lr()[0],
            grad_norm=float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm),
        )
        m.update(speed.report(self.global_token_sum))  # real / row tokens per s, step seconds, mfu
        m["compiled_graphs"] = compiled_graphs()
        if self.device.type == "cuda":  # the running peak (this rank's): when it rose, not only run.json's final one
            m["peak_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
        self.log.write({"step": n, "split": "train", **m})
        if bar:
            bar.set_postfix(
                loss=f"{m['loss']:.3f}",
                acc0=f"{m['acc_0']:.3f}",
                acc3=f"{m.get('acc_3', 0):.3f}",
                graphs=m["compiled_graphs"],
            )

    def loop(self, start, prefetch, stop, speed, bar, t0, results) -> dict:
        cfg = self.cfg
        for step in range(start, self.total_steps):
            b = next(prefetch)
            self.schedule = step / self.total_steps
            loss, stats, counts, ntok = self.forward(b["examples"], scale=float(self.world), b=b)
            # the finiteness check waits for the GPU: on GPU only at steps that sync anyway (log,
            # eval, checkpoint, stop), so a bad step is caught before anything is saved
            n = step + 1
            why = stop.why(check_ranks=n % cfg.log_every == 0) if n < self.total_steps else ""
            if not why and cfg.stop_after and n - start >= cfg.stop_after and n < self.total_steps:
                why = f"--stop-after {cfg.stop_after}"
            sync = (
                n % cfg.log_every == 0
                or n == self.total_steps
                or (cfg.ckpt_every and n % cfg.ckpt_every == 0)
                or (cfg.eval_every and n % cfg.eval_every == 0)
                or why
            )
            if (sync or self.device.type == "cpu") and not torch.isfinite(loss):
                prefetch.close()
                raise self.non_finite(step)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), cfg.grad_clip)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.after_step(step)
            if step == start:  # one wait for the GPU: the first step's time is mostly compiling (run.json's startup)
                self.sync_device()
                self.tick("first_step")
                self.print(
                    f"[time] first step done {self.startup['first_step']:.0f} s after start ("
                    + ", ".join(f"{k} {v:.0f} s" for k, v in self.startup.items() if k != "first_step")
                    + ")"
                )
            self.progress(f"step {step + 1}")
            speed.step(ntok, b["row_tokens"], self.sync_device)
            if (step + 1) % cfg.log_every == 0 or step + 1 == self.total_steps:
                self.log_step(step + 1, stats, counts, loss, gnorm, speed, bar)
            if bar:
                bar.update(1)
            evaluate = (
                cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < self.total_steps and self.eval_set
            )
            save = cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0
            if evaluate or save:
                speed.pause(self.sync_device)  # evaluation and checkpoints are not training throughput
                if evaluate:
                    ev = self.evaluate()
                    self.log.write({"step": step + 1, "split": "eval", **ev})
                if save:
                    self.save(step + 1)
                speed.resume()
            if why:
                if bar:
                    bar.close()
                prefetch.close()
                if not (cfg.ckpt_every and n % cfg.ckpt_every == 0):  # else saved just above
                    self.save(n)
                self.print(
                    f"[stop] {why}: after step {n}, checkpoint {self.out / 'ckpt' / f'step_{n}'}; "
                    "continue with --resume"
                )
                self.log.finish(
                    {
                        "stopped_at": n,
                        "stopped_by": why,
                        "train_seconds": time.time() - t0,
                        "packing": self.packing_summary(speed),
                        "startup_seconds": self.startup,
                    },
                    status="stopped",
                )
                return {"stopped_at": n, "stopped_by": why}
        if bar:
            bar.close()
        self.save(self.total_steps)
        if self.eval_set:
            results["eval_end"] = self.evaluate()
        results["train_seconds"] = time.time() - t0
        results["packing"] = self.packing_summary(speed)
        results["startup_seconds"] = self.startup
        if self.eval_set:
            self.print(f"[eval @{self.total_steps}] {fmt(results['eval_end'])}")
            self.log.write({"step": self.total_steps, "split": "eval", **results["eval_end"]})
        self.log.finish(results)
        o = self.out
        self.print(
            f"[out] {o}: checkpoint {o / 'ckpt' / f'step_{self.total_steps}'}, metrics {o / 'metrics.jsonl'}, "
            f"config and results {o / 'run.json'}, TensorBoard {o / 'tb'}; serve it: python export.py {o}"
        )
        return results


def fmt(m: dict) -> str:
    keys = sorted((k for k in m if k.startswith("acc_")), key=lambda k: int(k[4:]))
    return " ".join(f"{k}={m[k]:.3f}" for k in keys)
