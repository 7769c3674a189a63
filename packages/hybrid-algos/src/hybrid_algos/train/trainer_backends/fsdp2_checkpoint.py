"""Checkpoints of an FSDP2 role through ``torch.distributed.checkpoint`` (DCP): each rank writes its own shards.

The model and optimizer state dicts are DCP's (keys are parameter names, values DTensors), so a checkpoint saved on
N ranks loads onto any other rank count: DCP reshards on load from the metadata. The engine's own small state (the
learning-rate schedule, the update count) rides along as JSON bytes. DCP's coordinator writes ``.metadata`` last,
after every rank's shards are written, so a folder without it is an incomplete save and is refused on load.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import torch

METADATA = ".metadata"  # DCP's own file, written last


def save_sharded(
    checkpoint_dir: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
) -> None:
    """Collective: every rank writes its shards of ``module`` and ``optimizer`` (and ``extra``) under the folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optimizer": optim_state, "engine": io.BytesIO(json.dumps(extra).encode())}
    dcp.save(state, checkpoint_id=checkpoint_dir)


def load_sharded(checkpoint_dir: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: load the folder's state into ``module`` and ``optimizer`` (on any rank count); returns ``extra``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not os.path.isfile(os.path.join(checkpoint_dir, METADATA)):
        raise FileNotFoundError(f"no complete DCP checkpoint under {checkpoint_dir} (no {METADATA})")
    # DCP loads in place: the target state dicts (the optimizer's moments made up front) say what to read where
    model_state, optim_state = get_state_dict(module, optimizer)
    extra = io.BytesIO()
    state = {"model": model_state, "optimizer": optim_state, "engine": extra}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    loaded = state["engine"]
    return json.loads((loaded if isinstance(loaded, io.BytesIO) else extra).getvalue().decode())
