"""OpenRLHF 0.11.2's custom reward file for the peer runs: ``--reward.remote_url bench/openrlhf_reward.py``.

OpenRLHF loads a ``.py`` given as the remote reward URL inside each vLLM engine actor and calls
``reward_func(queries, prompts, labels)`` once per sample, in a thread: ``queries`` are the decoded prompt +
completion token ids (special tokens kept), ``prompts`` the prompt strings as the dataset gave them. It reads
``rewards`` (the training signal) and ``scores`` from the returned dict and wraps each in ``torch.tensor([x])``, so
a single sample's reward is returned as a Python float.

The reward is bench/peer_workload.py's ``copy_first``, the one `hybrid grpo` and the TRL peer train on. Our engine
decodes completions without special tokens, so the EOS / pad / unk tokens of the word-level vocabulary are
dropped here too before the rule counts.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_workload import copy_first

SPECIAL = frozenset({"</s>", "<pad>", "<unk>"})


def completion_of(query: str, prompt: str) -> str:
    """The completion part of ``query`` (prompt tokens + completion tokens, whitespace-joined)."""
    tokens = query.split()
    n_prompt = len(prompt.split())
    if tokens[:n_prompt] != prompt.split():
        raise ValueError(f"the query does not start with its prompt (prompt {prompt[:60]!r}, query {query[:60]!r})")
    return " ".join(t for t in tokens[n_prompt:] if t not in SPECIAL)


def reward_func(queries, prompts, labels=None):
    completions = [completion_of(q, p) for q, p in zip(queries, prompts)]
    rewards = copy_first(prompts, completions)
    value = rewards[0] if len(rewards) == 1 else rewards
    return {"rewards": value, "scores": value, "extra_logs": {}}
