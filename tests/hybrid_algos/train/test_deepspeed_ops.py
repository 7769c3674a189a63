"""DeepSpeed's CPU ops are built once in the driver; a build lock left by a killed build is cleared, a live one kept."""

from __future__ import annotations

import os
import time

from hybrid_algos.train.deepspeed_ops import clear_stale_locks, extensions_dir


def test_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path) -> None:
    old, new = tmp_path / "fused_adam", tmp_path / "deepspeed_shm_comm"
    old.mkdir(), new.mkdir()
    (old / "lock").touch(), (new / "lock").touch()
    an_hour_ago = time.time() - 3600
    os.utime(old / "lock", (an_hour_ago, an_hour_ago))

    removed = clear_stale_locks(str(tmp_path), max_age_s=600)

    assert removed == [str(old / "lock")]
    assert not (old / "lock").exists() and (new / "lock").exists()  # a build may still be running there


def test_extensions_dir_follows_torch_extensions_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_dir() == str(tmp_path)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert os.path.basename(extensions_dir()).startswith("py3")  # torch's own per-python default
