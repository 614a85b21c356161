"""Train a speculative-decoding draft for a frozen target.

    torchrun --nproc_per_node=N train.py --strategy eagle3 [--target DIR|FILE.gguf] [--data FILE] ...
    torchrun ... train.py --target DIR --features STORE ...   # offline: features from `capture.py features`

With no arguments it trains an EAGLE-3 draft for the packaged SmolLM2-135M-Instruct on the
packaged ShareGPT chats (CPU: fp32; GPU: bf16). Each run writes to --out: run.json (config,
versions, git commit, hardware, results), metrics.jsonl, tb/ (TensorBoard) and ckpt/step_N/.

Exit status: 0 finished (or stopped after --stop-after steps, as asked); 75 stopped early with a checkpoint by
--time-limit, a first SIGTERM or a first Ctrl-C (--resume continues it); 1 failed (one `error:` line); 130
interrupted without a checkpoint. run.json's "status" says the same: running | finished | stopped | failed |
interrupted ("running" after the process is gone: it was killed outright).
"""

import dataclasses
import os
import sys

from core.checkpoint import CheckpointError
from core.config import config_path
from core.disagg.roles import main as disagg_main
from core.distributed import barrier, destroy, exit_without_teardown
from core.train_config import ConfigError, TrainConfig, check_inputs, check_out, parse_cli, validate
from core.trainer import EXIT_INTERRUPTED, EXIT_STOPPED, Trainer
from core.vllm_features import vllm_target
from data.chat import DataError


def main(cfg: TrainConfig):
    """Train; the exit status says how it ended (exit_status). run.json's "status" says so too."""
    trainer = None
    try:
        validate(cfg)
        check_inputs(cfg)
        check_out(cfg, int(os.environ.get("RANK", 0)))
        trainer = Trainer(cfg)
        res = trainer.train()
        barrier()  # every rank's collectives (async ones of --tp too) done before any rank tears the group down
    except (DataError, FileNotFoundError, FloatingPointError, ConfigError, CheckpointError) as e:
        if trainer is not None:
            trainer.log.fail(str(e))
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:
        if trainer is not None:
            trainer.log.fail("interrupted (SIGINT)", status="interrupted")
        print("\ninterrupted (SIGINT): stopped without saving a checkpoint", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    finally:
        if trainer is not None and hasattr(trainer.target, "close"):  # --backend vllm: the engine process
            trainer.target.close()
        destroy()
    if code := exit_status(res):
        raise SystemExit(code)
    return res


def exit_status(res: dict) -> int:
    """0: finished, or stopped after --stop-after steps as asked; EXIT_STOPPED: stopped early by a signal or
    --time-limit, with a checkpoint (scripts tell an unfinished run from a finished one by it)."""
    why = res.get("stopped_by")
    return EXIT_STOPPED if why and not why.startswith("--stop-after") else 0


def run(cfg: TrainConfig):
    """A colocated run (main), or a role of disaggregated training: the launcher, a producer or a consumer rank."""
    if not (cfg.deploy.role or cfg.deploy.producers):
        return main(cfg)
    try:
        # the launcher checks the options and --out before starting the pools (a consumer restarted by hand
        # into its own --out resumes: core/disagg/roles.py)
        if not cfg.deploy.role:
            validate(cfg)
            check_inputs(cfg)
            check_out(cfg)
        disagg_main(cfg, Trainer, vllm_target)
    except (ConfigError, CheckpointError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    cfg = parse_cli(sys.argv[1:])  # flags, or --config run.yaml with flags overriding it
    cfg = dataclasses.replace(cfg, config=config_path(sys.argv[1:]) or cfg.config)
    # under torchrun (colocated ranks, or --consumer-ranks N of disaggregated training): the same run, ended
    # without the interpreter's teardown (exit_without_teardown says why)
    if "RANK" in os.environ:
        try:
            run(cfg)
        except SystemExit as e:
            exit_without_teardown(e.code)
        exit_without_teardown(0)
    else:
        run(cfg)
