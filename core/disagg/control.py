"""The control plane of disaggregated training: one SQLite database that every producer and
consumer opens (a directory on one node, or shared by several). It moves only SampleRefs.

    items(pos, step, sample, state, worker, attempts, key, off, len, error)
        one row per (training position, sample): the run's data order laid out up front, eval
        samples first (step -1), then step s's global batch at pos E + s*B + j, exactly
        GlobalBatches' order. state: pending -> leased (a producer runs the target) -> ready
        (features in the store, the ref here) -> trained (the consumer stepped on it, features
        deleted). A dead producer's leases go back to pending; a consumer restarted from an
        older checkpoint puts the steps it lost back to pending (producers recompute them).
    workers(id, name, role, pid, host, beat, state)     heartbeats
    ledger(pos PRIMARY KEY, step, sample, t)            what the weights were trained on; the
        primary key makes a second record of one position an error, not a double count
    meta(k, v)                                          plan fingerprint, run state, counters

Why SQLite: every transition is one transaction (BEGIN IMMEDIATE takes the write lock), so
leases are disjoint, a publish from a producer that lost its lease is refused, and the ledger
and the ack commit together; a crash of any member leaves a consistent database that a
restarted member continues from; no server to keep alive. The rollback journal (not WAL) is
used so the file also works on a network filesystem with POSIX locks.

Back-pressure is a window over the data order: a producer may lease position p only if
p < first untrained position + high watermark, so at most `high` samples are leased or ready.
Hitting the window edge pauses new leases until in-flight samples drop to `low` (hysteresis,
so producers work in bursts); positions that were given back (holes behind the frontier) are
always leasable, so a paused pipeline can still fill the step the consumer waits for.
"""

import json
import os
import socket
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from data.feature_store import SampleRef

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v TEXT);
CREATE TABLE IF NOT EXISTS items(pos INTEGER PRIMARY KEY, step INTEGER NOT NULL, sample INTEGER NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending', worker INTEGER, attempts INTEGER NOT NULL DEFAULT 0,
    key TEXT, off INTEGER, len INTEGER, error TEXT);
CREATE INDEX IF NOT EXISTS items_state ON items(state, pos);
CREATE INDEX IF NOT EXISTS items_step ON items(step);
CREATE INDEX IF NOT EXISTS items_key ON items(key);
CREATE TABLE IF NOT EXISTS workers(id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT, role TEXT, pid INTEGER,
    host TEXT, beat REAL, state TEXT);
CREATE TABLE IF NOT EXISTS ledger(pos INTEGER PRIMARY KEY, step INTEGER NOT NULL, sample INTEGER NOT NULL, t REAL);
"""


class PipelineError(RuntimeError):
    """The run cannot go on (the message says why); recorded in the database for every member."""


def plan_items(batches, total_steps: int, n_eval: int) -> list[tuple[int, int, int]]:
    """[(pos, step, sample)]: eval samples (ids n_train..n_train+n_eval-1) then every step's
    global batch in GlobalBatches order (train sample ids index the train split)."""
    out = [(j, -1, batches.n + j) for j in range(n_eval)]
    for s in range(total_steps):
        out += [(len(out) + j, s, i) for j, i in enumerate(batches.indices(s))]
    return out


class Controller:
    def __init__(self, root, lease_timeout: float = 30.0, max_attempts: int = 3):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.lease_timeout, self.max_attempts = lease_timeout, max_attempts
        self._local = threading.local()
        with self.tx():
            for stmt in filter(str.strip, _SCHEMA.split(";")):
                self.db.execute(stmt)

    @property
    def db(self) -> sqlite3.Connection:
        """One connection per thread (a consumer's prefetch thread waits while its main thread acks)."""
        if getattr(self._local, "db", None) is None:
            self._local.db = sqlite3.connect(self.root / "control.db", timeout=120, isolation_level=None)
            self._local.db.execute("PRAGMA synchronous=NORMAL")
        return self._local.db

    @contextmanager
    def tx(self):
        """One write transaction (serialised across processes by SQLite's lock)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _get(self, k, default=None):
        row = self.db.execute("SELECT v FROM meta WHERE k=?", (k,)).fetchone()
        return json.loads(row[0]) if row else default

    def _set(self, k, v):
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, json.dumps(v)))

    # ---- the plan ----
    def init_plan(self, items: list[tuple[int, int, int]], fingerprint: dict, batch_size: int):
        """Lay out the run's data order once; every later member must bring the same plan."""
        with self.tx():
            have = self._get("plan")
            if have is None:
                self.db.executemany("INSERT INTO items(pos, step, sample) VALUES (?, ?, ?)", items)
                self._set("plan", fingerprint)
                self._set("batch_size", batch_size)
                self._set("state", "running")
            elif have != fingerprint:
                diff = {
                    k: (have.get(k), fingerprint.get(k))
                    for k in set(have) | set(fingerprint)
                    if have.get(k) != fingerprint.get(k)
                }
                raise PipelineError(
                    f"{self.root} belongs to another run (differs in {diff}); "
                    "use another --control / --out, or the launcher without --resume"
                )

    # ---- run state ----
    def state(self) -> tuple[str, str | None]:
        return self._get("state", "running"), self._get("error")

    def fail(self, message: str):
        with self.tx():
            if self._get("state") != "failed":  # the first cause is kept
                self._set("state", "failed")
                self._set("error", message)

    def finish(self):
        with self.tx():
            self._set("state", "done")

    def check(self):
        state, error = self.state()
        if state == "failed":
            raise PipelineError(error)

    # ---- members ----
    def register(self, role: str, name: str = "") -> int:
        host, pid = socket.gethostname(), os.getpid()
        with self.tx():
            cur = self.db.execute(
                "INSERT INTO workers(name, role, pid, host, beat, state) VALUES (?, ?, ?, ?, ?, 'alive')",
                (name or f"{host}-{pid}", role, pid, host, time.time()),
            )
            return cur.lastrowid

    def beat(self, wid: int):
        with self.tx():
            self._beat(wid)

    def _beat(self, wid: int):  # a member presumed dead that beats again is alive (its old leases are gone)
        self.db.execute("UPDATE workers SET beat=?, state='alive' WHERE id=? AND state!='left'", (time.time(), wid))

    def leave(self, wid: int):
        """A clean exit: leases go back to the pool at once."""
        with self.tx():
            self.db.execute("UPDATE items SET state='pending', worker=NULL WHERE state='leased' AND worker=?", (wid,))
            self.db.execute("UPDATE workers SET state='left' WHERE id=?", (wid,))

    def live_producers(self) -> list[str]:
        rows = self.db.execute(
            "SELECT name FROM workers WHERE role='producer' AND state='alive' AND beat>?",
            (time.time() - self.lease_timeout,),
        ).fetchall()
        return [r[0] for r in rows]

    def last_producer_beat(self) -> float | None:
        return self.db.execute("SELECT MAX(beat) FROM workers WHERE role='producer'").fetchone()[0]

    def _reclaim(self):
        """Leases of producers silent for lease_timeout go back to pending; a prompt leased
        max_attempts times fails the run (inside the caller's transaction)."""
        dead = self.db.execute(
            "SELECT id, name FROM workers WHERE role='producer' AND state='alive' AND beat<?",
            (time.time() - self.lease_timeout,),
        ).fetchall()
        for wid, name in dead:
            self.db.execute("UPDATE workers SET state='dead' WHERE id=?", (wid,))
            self.db.execute(
                "UPDATE items SET state='pending', worker=NULL, error=? WHERE state='leased' AND worker=?",
                (f"producer {name} stopped heartbeating", wid),
            )
        self._check_attempts()

    def _check_attempts(self):
        bad = self.db.execute(
            "SELECT pos, sample, attempts, error FROM items WHERE state='pending' AND attempts>=? ORDER BY pos LIMIT 1",
            (self.max_attempts,),
        ).fetchone()
        if bad and self._get("state") != "failed":
            pos, sample, attempts, error = bad
            self._set("state", "failed")
            self._set(
                "error",
                f"sample {sample} (queue position {pos}) was leased {attempts} times and never produced "
                f"(last: {error}); retry budget --max-attempts {self.max_attempts} exhausted",
            )

    # ---- producers ----
    def lease(self, wid: int, n: int, high: int, low: int) -> list[tuple[int, int, int]]:
        """Up to n consecutive-in-order prompts [(pos, sample, attempt)] for producer wid (all
        eval or all train), within the back-pressure window; [] when there is nothing to do now."""
        with self.tx():
            self._beat(wid)
            self._reclaim()
            if self._get("state") != "running":
                return []
            q = lambda sql, *a: self.db.execute(sql, a).fetchone()[0]
            lo = q("SELECT MIN(pos) FROM items WHERE step>=0 AND state!='trained'")
            if lo is None:  # everything trained
                return []
            inflight = q("SELECT COUNT(*) FROM items WHERE step>=0 AND state IN ('leased','ready')")
            frontier = q("SELECT COALESCE(MAX(pos)+1, ?) FROM items WHERE step>=0 AND state!='pending'", lo)
            paused = self._get("paused", False)
            if paused and inflight <= low:
                paused = False
                self._set("resumes", self._get("resumes", 0) + 1)
            if (
                not paused
                and frontier >= lo + high
                and q("SELECT COUNT(*) FROM items WHERE state='pending' AND pos>=?", frontier)
            ):
                paused = True
                self._set("pauses", self._get("pauses", 0) + 1)
            self._set("paused", paused)
            limit = frontier if paused else lo + high  # paused: only holes behind the frontier
            rows = self.db.execute(
                "SELECT pos, step, sample, attempts FROM items WHERE state='pending' AND (step<0 OR pos<?) "
                "ORDER BY pos LIMIT ?",
                (limit, n),
            ).fetchall()
            rows = [r for r in rows if (r[1] < 0) == (rows[0][1] < 0)] if rows else []
            for pos, _, _, _ in rows:
                self.db.execute(
                    "UPDATE items SET state='leased', worker=?, attempts=attempts+1 WHERE pos=?", (wid, pos)
                )
            if rows and rows[0][1] >= 0:
                self._set("max_inflight", max(self._get("max_inflight", 0), inflight + len(rows)))
            return [(pos, sample, attempts + 1) for pos, _, sample, attempts in rows]

    def publish(self, wid: int, refs: list[tuple[int, SampleRef]]) -> bool:
        """Make produced samples visible: [(pos, SampleRef)]. Only refs cross the control plane
        (anything else is refused). False (and the caller drops its shard) when this producer
        no longer holds every lease, e.g. it was presumed dead and the prompts went elsewhere."""
        for pos, r in refs:
            if (
                type(r) is not SampleRef
                or not all(type(x) is int for x in (pos, r.id, r.offset, r.length))
                or type(r.key) is not str
            ):
                raise TypeError(
                    f"the control plane moves only SampleRef(id, key, offset, length) records, got {type(r).__name__}"
                )
        with self.tx():
            mine = [
                pos
                for pos, _ in refs
                if self.db.execute(
                    "SELECT 1 FROM items WHERE pos=? AND state='leased' AND worker=?", (pos, wid)
                ).fetchone()
            ]
            if len(mine) < len(refs):
                self.db.executemany("UPDATE items SET state='pending', worker=NULL WHERE pos=?", [(p,) for p in mine])
                return False
            self.db.executemany(
                "UPDATE items SET state='ready', key=?, off=?, len=?, error=NULL WHERE pos=?",
                [(r.key, r.offset, r.length, pos) for pos, r in refs],
            )
            return True

    def give_back(self, wid: int, positions: list[int], error: str):
        """A producer could not produce these prompts (the error is kept; attempts count)."""
        with self.tx():
            self.db.executemany(
                "UPDATE items SET state='pending', worker=NULL, error=? WHERE pos=? AND worker=? AND state='leased'",
                [(error, p, wid) for p in positions],
            )
            self._check_attempts()

    # ---- consumers ----
    def step_refs(self, step: int) -> list[SampleRef] | None:
        """The refs of one optimizer step (or of the eval set, step -1) in data order, once all
        of them are ready: the release quantum that keeps every consumer rank in step."""
        rows = self.db.execute(
            "SELECT state, sample, key, off, len FROM items WHERE step=? ORDER BY pos", (step,)
        ).fetchall()
        if not rows or any(r[0] not in ("ready", "trained") or r[2] is None for r in rows):
            return None
        return [SampleRef(sample, key, off, n) for _, sample, key, off, n in rows]

    def wait_step(self, step: int, producer_timeout: float, poll: float = 0.05) -> list[SampleRef]:
        """Block until step's refs are all ready. Fails the run (for everyone) when no producer
        has been alive for producer_timeout seconds, counted from when this wait began."""
        t0 = last_reclaim = time.time()
        while True:
            refs = self.step_refs(step)
            if refs is not None:
                return refs
            self.check()
            if time.time() - last_reclaim > 1.0:  # producers reclaim too, at every lease
                with self.tx():
                    self._reclaim()
                last_reclaim = time.time()
            if not self.live_producers():
                since = max(t0, self.last_producer_beat() or 0)
                if time.time() - since > producer_timeout:
                    have = self.db.execute(
                        "SELECT COUNT(*), SUM(state='ready') FROM items WHERE step=?", (step,)
                    ).fetchone()
                    self.fail(
                        f"all producers are gone: none has sent a heartbeat for {time.time() - since:.0f} s "
                        f"(--producer-timeout {producer_timeout:g}); {'eval set' if step < 0 else f'step {step}'} "
                        f"has {have[1] or 0}/{have[0]} samples produced. Start producers (--role producer) to continue"
                    )
            self.check()
            time.sleep(poll)

    def ack(self, step: int) -> list[str]:
        """After optimizer step `step`: record its samples in the ledger and mark them trained,
        in one transaction. Returns the store keys none of whose samples is needed any more."""
        with self.tx():
            rows = self.db.execute(
                "SELECT pos, sample, key FROM items WHERE step=? AND state='ready'", (step,)
            ).fetchall()
            now = time.time()
            self.db.executemany("INSERT INTO ledger VALUES (?, ?, ?, ?)", [(p, step, s, now) for p, s, _ in rows])
            self.db.execute("UPDATE items SET state='trained' WHERE step=? AND state='ready'", (step,))
            keys = sorted({k for _, _, k in rows})
            return [
                k
                for k in keys
                if not self.db.execute("SELECT 1 FROM items WHERE key=? AND state!='trained' LIMIT 1", (k,)).fetchone()
            ]

    def rollback(self, from_step: int) -> int:
        """The consumer restarts from a checkpoint taken after step from_step-1: steps it had
        trained since are not in the weights. Their ledger rows go, their prompts return to the
        pool (their features were deleted at ack; producers recompute them)."""
        with self.tx():
            n = self.db.execute("DELETE FROM ledger WHERE step>=?", (from_step,)).rowcount
            self.db.execute(
                "UPDATE items SET state='pending', worker=NULL, key=NULL, off=NULL, len=NULL, attempts=0 "
                "WHERE step>=? AND state='trained'",
                (from_step,),
            )
            if self._get("state") == "done":
                self._set("state", "running")
            return n

    def unused_keys(self) -> set[str]:
        return {
            r[0] for r in self.db.execute("SELECT DISTINCT key FROM items WHERE key IS NOT NULL AND state!='trained'")
        }

    # ---- inspection ----
    def ledger(self) -> list[tuple[int, int, int]]:
        return self.db.execute("SELECT pos, step, sample FROM ledger ORDER BY pos").fetchall()

    def stats(self) -> dict:
        counts = dict(self.db.execute("SELECT state, COUNT(*) FROM items GROUP BY state").fetchall())
        return {
            "items": counts,
            "max_inflight": self._get("max_inflight", 0),
            "pauses": self._get("pauses", 0),
            "resumes": self._get("resumes", 0),
            "state": self._get("state"),
            "error": self._get("error"),
            "workers": self.db.execute("SELECT name, role, state, pid FROM workers ORDER BY id").fetchall(),
        }

    def close(self):
        self.db.close()
        self._local.db = None
