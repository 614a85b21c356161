"""runlog.git_commit: a dirty working copy is named by the git tree of its files, which is the tree of
the commit that later holds exactly those files (how a device run, made on top of an older HEAD, is traced)."""

import subprocess
import time

from core.runlog import Heartbeat, git_commit


def test_dirty_tree_names_the_commit_that_holds_it(tmp_path):
    git = lambda *a: subprocess.run(  # noqa: E731
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *a],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    git("init", "-q")
    (tmp_path / "a.py").write_text("one\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    head = git("rev-parse", "HEAD")
    assert git_commit(tmp_path) == head  # clean
    (tmp_path / "a.py").write_text("two\n")
    (tmp_path / "new.py").write_text("untracked\n")  # untracked files are part of what ran
    label = git_commit(tmp_path)
    assert label.startswith(head + "+dirty tree ")
    assert "new.py" not in git("diff", "--cached", "--name-only")  # the repository's own index untouched
    git("add", "-A")
    git("commit", "-qm", "second")
    assert label.split()[-1] == git("rev-parse", "HEAD^{tree}")


def test_heartbeat_says_when_nothing_finishes():
    """runlog.Heartbeat: one line per quiet interval, naming the last thing done; marks keep it silent."""
    said = []
    hb = Heartbeat(0.4, said.append)
    for i in range(6):  # busy: something finishes every 0.1 s
        time.sleep(0.1)
        hb.mark(f"step {i}")
    assert said == []
    time.sleep(1.0)  # quiet for ~2.5 intervals: one line, then one more
    hb.close()
    assert 1 <= len(said) <= 3 and all("last done: step 5" in s and "torch.compile graphs so far: " in s for s in said)
    # the first line of the quiet stretch says where the owning thread was: here, in time.sleep's caller
    assert "now in:" in said[0] and "test_heartbeat_says_when_nothing_finishes" in said[0]
    assert all("now in:" not in s for s in said[1:])
