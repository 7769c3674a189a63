"""``hybrid grpo --dry-run --teacher_pretrain``: a Qwen2-1.5B-shaped student and a Qwen2-7B-shaped teacher
(config-only folders with one tokenizer; sizing reads the configs) planned colocated on one 80 GB GPU -- the teacher
a role of its own with its own bytes and its own phase -- and a teacher that reads other token ids refused."""

from __future__ import annotations

import re

import pytest

from hybrid_cli.main import main

QWEN2_1_5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
)
QWEN2_7B = dict(QWEN2_1_5B, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28)
QWEN2_7B["num_key_value_heads"] = 4


def _folder(path, shape, symbols: int = 8) -> str:
    from hybrid_algos.train.tiny import build_tiny_tokenizer, tiny_model_config

    tiny_model_config(**shape).save_pretrained(path)
    build_tiny_tokenizer(symbols).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill-configs")
    return _folder(root / "student", QWEN2_1_5B), _folder(root / "teacher", QWEN2_7B)


def test_a_7b_teacher_and_a_1_5b_student_are_planned_on_one_gpu(folders, tmp_path, capsys):
    student, teacher = folders
    argv = ["grpo", "--dry-run", "--pretrain", student, "--teacher_pretrain", teacher, "--save_path", str(tmp_path)]
    budget = ["--bf16", "--gpu_memory_gb", "80", "--host_memory_gb", "256"]
    assert main([*argv, *budget]) == 0
    out = capsys.readouterr().out
    assert re.search(r"teacher\s+1\s+1\s+0\s", out)  # a worker of its own on the actor's GPU
    assert f"distillation: teacher {teacher}" in out
    phases = re.findall(r"^  (\w+)\s+peak", out, flags=re.M)
    assert phases.index("reference") < phases.index("teacher") < phases.index("actor_train")
    in_its_phase = out.split("\n  teacher ")[1].split("\n  actor_train")[0]
    assert "teacher[params]" in in_its_phase  # its weights are there in its phase
    # the teacher's bytes are the 7B's: the same plan without it needs ~14 GiB (bf16 7B) less at its peak
    peak = float(re.search(r"fullest GPU is GPU 0 in phase \w+: ([\d.]+)", out).group(1))
    assert main([*argv[:4], "--save_path", str(tmp_path), *budget]) == 0
    alone = float(re.search(r"fullest GPU is GPU 0 in phase \w+: ([\d.]+)", capsys.readouterr().out).group(1))
    assert 13 < peak - alone < 16


def test_a_teacher_with_another_tokenizer_is_refused(folders, tmp_path, capsys):
    student, _ = folders
    other = _folder(tmp_path / "other", QWEN2_1_5B, symbols=12)
    assert main(["grpo", "--dry-run", "--pretrain", student, "--teacher_pretrain", other, "--gpu_memory_gb", "80"]) != 0
    captured = capsys.readouterr()
    assert "teacher_pretrain" in captured.err and "not the policy's" in captured.err
