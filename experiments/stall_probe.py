"""Run train.py (same flags) with a watch on where it spends a stall: every --every seconds the other
threads' stacks go to --stacks (a Python thread reading sys._current_frames), and at exit torch.compile's
time per phase and the number of graphs compiled go to stderr. For the H200 stall of issue 31 (first held-out
evaluation of the mix: nothing for ~400 s compiled, 31-35 s per batch eager).

  python3 experiments/stall_probe.py --stacks /tmp/stacks.txt --every 20 -- --target ... (train.py flags)
"""

import atexit
import runpy
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit("usage: stall_probe.py --stacks FILE [--every S] -- TRAIN_FLAGS...")
    own, train_args = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    stacks = Path(own[own.index("--stacks") + 1])
    every = float(own[own.index("--every") + 1]) if "--every" in own else 20.0
    t0 = time.time()
    stop = threading.Event()

    def watch():
        # not faulthandler.dump_traceback_later: its C watchdog reads other threads' frames without the GIL and
        # segfaults when one of them changes under it (a known CPython crash: exit 139 at 60 s, mid-dump, on the
        # H100, experiments/results/defaults_h100_run3/README.md). sys._current_frames() is read under the GIL:
        # the same stacks. (A compiled run under this probe still aborted once at exit, after its report.)
        with open(stacks, "w") as f:
            while not stop.wait(every):
                f.write(f"--- {time.time() - t0:.0f} s\n")
                for tid, frame in sys._current_frames().items():
                    if tid != threading.get_ident():  # not this thread's own stack
                        f.write(f"Thread {tid:#x} (most recent call last):\n{''.join(traceback.format_stack(frame))}\n")
                f.flush()

    threading.Thread(target=watch, name="stall-probe", daemon=True).start()

    def report():
        stop.set()
        import torch._dynamo.utils as du  # at exit, after train.py ran: the probe imports no torch of its own

        print(f"[probe] {time.time() - t0:.0f} s; compile times:\n{du.compile_times()}", file=sys.stderr, flush=True)
        counters = {k: dict(v) for k, v in du.counters.items() if v}
        print(f"[probe] dynamo counters: {counters}", file=sys.stderr, flush=True)

    atexit.register(report)
    sys.path.insert(0, str(ROOT))
    sys.argv = [str(ROOT / "train.py"), *train_args]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
