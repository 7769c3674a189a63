"""Resuming with a different run length under a decaying learning-rate schedule is said, not silent."""

import dataclasses
import logging

from tiny_runs import tiny_config

from hybrid_algos.train.resume import check_compatible, essentials


def _saved_state(cfg, **changes):
    old = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    old.update(changes)
    return {"essentials": essentials(cfg), "config": old}


def test_a_cosine_run_resumed_with_more_steps_says_the_rate_moves(tmp_path, caplog):
    cfg = tiny_config(tmp_path, lr_scheduler="cosine_with_min_lr", min_lr_ratio=0.1, max_steps=20)
    with caplog.at_level(logging.WARNING, logger="hybrid_algos.train.resume"):
        check_compatible(cfg, _saved_state(cfg, max_steps=10), "ckpt")
    text = caplog.text
    assert "max_steps 10 -> 20" in text
    assert "cosine decay is spread over the new length" in text and "Keep --max_steps" in text


def test_a_constant_schedule_or_the_same_length_gets_no_schedule_note(tmp_path, caplog):
    constant = tiny_config(tmp_path, lr_scheduler="constant_with_warmup", max_steps=20)
    cosine = tiny_config(tmp_path, lr_scheduler="cosine_with_min_lr", max_steps=20)
    with caplog.at_level(logging.WARNING, logger="hybrid_algos.train.resume"):
        check_compatible(constant, _saved_state(constant, max_steps=10), "ckpt")
        check_compatible(cosine, _saved_state(cosine), "ckpt")
    assert "cosine decay" not in caplog.text
    assert "max_steps 10 -> 20" in caplog.text  # the plain note of a changed setting still comes
