"""publish_directory: a staged directory replaces its target whole. A crash before any of its steps (simulated by
an exception no handler catches, raised in place of that step) leaves the old or the new version whole, where the
caller looks for it; an error in the publishing rename puts the old version back; an empty-only target is never
written over once it fills up; and every staged file reaches the disk before the rename that publishes it."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from zofed import atomic_files
from zofed.atomic_files import publish_directory
from zofed.run.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint


class Crash(BaseException):
    """Stands for a kill: no `except OSError` or `except Exception` sees it."""


def _stage(path: Path, version: str) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "a.txt").write_text(f"a {version}")
    (path / "sub" / "b.txt").write_text(f"b {version}")
    return path


def _contents(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def _crash_at(monkeypatch: pytest.MonkeyPatch, step: int) -> list[str]:
    """Make the `step`-th of publish_directory's disk steps (a flush, a rename or a delete) raise Crash instead
    of running; returns the names of the steps seen, crashed one included."""
    seen: list[str] = []

    def wrap(name, real):
        def step_or_crash(*args, **kwargs):
            seen.append(name)
            if len(seen) - 1 == step:
                raise Crash(name)
            return real(*args, **kwargs)
        return step_or_crash

    monkeypatch.setattr(atomic_files, "fsync_path", wrap("fsync", atomic_files.fsync_path))
    monkeypatch.setattr(os, "replace", wrap("replace", os.replace))
    monkeypatch.setattr(shutil, "rmtree", wrap("rmtree", shutil.rmtree))
    return seen


def _count_steps(publish) -> int:
    """How many disk steps `publish()` takes."""
    with pytest.MonkeyPatch.context() as patch:
        seen = _crash_at(patch, -1)
        publish()
    return len(seen)


def test_a_staged_directory_replaces_its_target_and_the_old_one_goes(tmp_path):
    target, aside = _stage(tmp_path / "target", "old"), tmp_path / "target.old"
    (target / "only-in-old.txt").write_text("stale")
    publish_directory(_stage(tmp_path / "staged", "new"), target, aside=aside)
    assert _contents(target) == {"a.txt": "a new", "sub/b.txt": "b new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
    publish_directory(_stage(tmp_path / "first", "first"), tmp_path / "fresh", aside=tmp_path / "fresh.old")
    assert _contents(tmp_path / "fresh") == {"a.txt": "a first", "sub/b.txt": "b first"}


@pytest.mark.parametrize("existing", [True, False])
def test_a_crash_before_any_step_leaves_the_old_or_the_new_directory_whole(tmp_path, monkeypatch, existing):
    old, new = {"a.txt": "a old", "sub/b.txt": "b old"}, {"a.txt": "a new", "sub/b.txt": "b new"}
    probe = tmp_path / "probe"
    if existing:
        _stage(probe / "target", "old")
    staged = _stage(probe / "staged", "new")
    steps = _count_steps(lambda: publish_directory(staged, probe / "target", aside=probe / "target.old"))
    # 4 flushes of the staged files and dirs, the rename, the parent's flush, the aside's delete; and with an
    # old version: a leftover aside deleted, the old version moved aside and that flushed
    assert steps == (10 if existing else 7)
    states = set()
    for step in range(steps):
        root = tmp_path / f"crash-{step}"
        target, aside = root / "target", root / "target.old"
        if existing:
            _stage(target, "old")
        staged = _stage(root / "staged", "new")
        with monkeypatch.context() as patch:
            _crash_at(patch, step)
            with pytest.raises(Crash):
                publish_directory(staged, target, aside=aside)
        if not target.exists():  # the swap was cut between its renames, or nothing was published yet
            states.add("old at the aside" if existing else "none yet")
            assert _contents(aside) == old if existing else not aside.exists()
        else:
            states.add("new" if _contents(target) == new else "old")
            assert _contents(target) in (old, new)
        publish_directory(_stage(root / "again", "new"), target, aside=aside)  # the next call clears the aside
        assert _contents(target) == new and not aside.exists()
    assert states == ({"old", "old at the aside", "new"} if existing else {"none yet", "new"})


def test_an_error_in_the_publishing_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    target, aside = _stage(tmp_path / "target", "old"), tmp_path / "target.old"
    staged = _stage(tmp_path / "staged", "new")
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if Path(src) == staged:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        publish_directory(staged, target, aside=aside)
    assert calls == [("target", "target.old"), ("staged", "target"), ("target.old", "target")]
    assert _contents(target) == {"a.txt": "a old", "sub/b.txt": "b old"} and not aside.exists()
    assert _contents(staged) == {"a.txt": "a new", "sub/b.txt": "b new"}  # the caller's to retry or delete


def test_without_an_aside_only_an_absent_or_empty_target_is_replaced(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    publish_directory(_stage(tmp_path / "one", "one"), empty)
    assert _contents(empty) == {"a.txt": "a one", "sub/b.txt": "b one"}
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="full is not empty"):
        publish_directory(_stage(tmp_path / "two", "two"), full)
    assert _contents(full) == {"mine.txt": "keep me"}
    assert _contents(tmp_path / "two") == {"a.txt": "a two", "sub/b.txt": "b two"}


def test_every_staged_file_is_on_disk_before_the_rename_that_publishes_it(tmp_path, monkeypatch):
    target, staged = _stage(tmp_path / "target", "old"), _stage(tmp_path / "staged", "new")
    events, real = [], os.replace
    monkeypatch.setattr(atomic_files, "fsync_path", lambda path: events.append(("fsync", Path(path))))
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", Path(dst))), real(src, dst)))
    publish_directory(staged, target, aside=tmp_path / "target.old")
    publishing = events.index(("replace", target))
    flushed_before = {path for kind, path in events[:publishing] if kind == "fsync"}
    assert flushed_before >= {staged / "a.txt", staged / "sub" / "b.txt", staged / "sub", staged}
    assert ("fsync", tmp_path) in events[:publishing]  # the old one is safe at its aside first
    assert events[publishing + 1:] == [("fsync", tmp_path)]  # then the rename itself reaches the disk


def _checkpoint(version: float) -> tuple[dict, dict]:
    return {"trainable": {"w": torch.full((3,), version)}, "optimizer": {"m": torch.full((2,), -version)}}, \
        {"round": int(version)}


def test_a_checkpoint_crashed_at_any_step_of_its_swap_loads_whole(tmp_path, monkeypatch):
    probe = tmp_path / "probe" / "checkpoint"
    save_checkpoint(probe, *_checkpoint(1.0))
    steps = _count_steps(lambda: save_checkpoint(probe, *_checkpoint(2.0)))
    recovered = set()
    for step in range(steps):
        directory = tmp_path / f"crash-{step}" / "checkpoint"
        save_checkpoint(directory, *_checkpoint(1.0))
        with monkeypatch.context() as patch:
            _crash_at(patch, step)
            with pytest.raises(Crash):
                save_checkpoint(directory, *_checkpoint(2.0))
        tensors, meta = load_checkpoint(directory)
        version = float(meta["round"])
        assert version in (1.0, 2.0) and torch.equal(tensors["trainable"]["w"], torch.full((3,), version))
        assert torch.equal(tensors["optimizer"]["m"], torch.full((2,), -version))
        recovered.add((find_checkpoint(directory).name, version))
        save_checkpoint(directory, *_checkpoint(3.0))  # a resumed run's next checkpoint clears what is left
        assert load_checkpoint(directory)[1] == {"round": 3}
        assert sorted(p.name for p in directory.parent.iterdir()) == ["checkpoint"]
    assert recovered == {("checkpoint", 1.0), ("checkpoint.old", 1.0), ("checkpoint", 2.0)}
