"""CUDA MPS detection: a running control daemon leaves a FIFO named ``control`` in its pipe folder."""

import os

from hybrid_core.mps import mps_note, mps_pipe_directory


def test_a_control_fifo_in_the_pipe_folder_means_mps_is_running(tmp_path):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert mps_pipe_directory(env) is None and "not running" in mps_note(env)
    (tmp_path / "control").write_text("")  # a plain file is not the daemon's pipe
    assert mps_pipe_directory(env) is None
    os.remove(tmp_path / "control")
    os.mkfifo(tmp_path / "control")
    assert mps_pipe_directory(env) == str(tmp_path)
    assert mps_note(env).startswith(f"CUDA MPS is running ({tmp_path})")


def test_without_the_variable_the_daemons_default_folder_is_asked(tmp_path, monkeypatch):
    import hybrid_core.mps as mps

    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIRECTORY", str(tmp_path))
    assert mps_pipe_directory({}) is None
    os.mkfifo(tmp_path / "control")
    assert mps_pipe_directory({}) == str(tmp_path)
    assert mps_pipe_directory({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "elsewhere")}) is None
