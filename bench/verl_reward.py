"""verl 0.9.1's custom reward function for the peer runs: ``reward.custom_reward_function.path=bench/verl_reward.py``.

verl's reward loop (its ``naive`` reward manager) loads this file in each reward worker and calls
``compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`` once per sample:
``solution_str`` is the response decoded with ``skip_special_tokens=True`` (as our engine decodes completions), and
``ground_truth`` / ``extra_info`` are the row's ``reward_model.ground_truth`` and ``extra_info`` columns as
bench/verl_peer.py writes them (the prompt's first token, and the prompt itself).

The reward is bench/peer_workload.py's ``copy_first``, the one `hybrid grpo`, TRL and OpenRLHF train on.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_workload import copy_first


def compute_score(data_source=None, solution_str="", ground_truth=None, extra_info=None, **_):
    prompt = (extra_info or {}).get("prompt")
    if not prompt:
        raise ValueError("the row has no extra_info.prompt: write the data with bench/verl_peer.py (write_data)")
    if ground_truth is not None and prompt.split()[0] != ground_truth:
        raise ValueError(f"ground_truth {ground_truth!r} is not the first token of the prompt {prompt[:60]!r}")
    return float(copy_first([prompt], [solution_str])[0])
