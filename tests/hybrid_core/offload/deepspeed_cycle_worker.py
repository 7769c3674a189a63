"""Run by test_offload_deepspeed.py in a fresh process (DeepSpeed wants RANK/WORLD_SIZE/MASTER_* and its own dist).

For each ZeRO stage: two identical engines train on the same batches; one sleeps and wakes (DeepSpeedOffloader)
between steps. Prints one JSON line per stage with both loss sequences, whether the final weights match, and the
offloader's stats.
"""

import json
import os
import sys
from datetime import timedelta

import torch


def build(stage: int, client_optimizer: bool = False):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
    )
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "steps_per_print": 1 << 30,
    }
    if client_optimizer:
        del config["optimizer"]
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def refused_field(engine) -> str | None:
    from hybrid_core.errors import ConfigError
    from hybrid_core.offload import DeepSpeedOffloader

    try:
        DeepSpeedOffloader(engine)
    except ConfigError as e:
        return e.field
    return None


def train(engine, batches, offloader=None):
    losses, stats = [], []
    for i, (x, y) in enumerate(batches):
        if offloader is not None and i > 0:  # after the first step, so the optimizer state exists
            stats.append((offloader.sleep().as_dict(), offloader.asleep))
            stats.append((offloader.wake().as_dict(), offloader.asleep))
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, stats


def full_params(engine):
    import deepspeed

    out = []
    for p in engine.module.parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            out.append(p.detach().clone())
    return out


def main() -> None:
    import gc

    import deepspeed

    from hybrid_core.offload import DeepSpeedOffloader

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120), verbose=False)
    gc.freeze()  # offload_states runs gc.collect() three times; over the whole import heap that costs ~1 s each
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)) for _ in range(3)]
    refusals = {"no_zero": refused_field(build(0)), "client_optimizer": refused_field(build(1, client_optimizer=True))}
    print("REFUSALS " + json.dumps(refusals), flush=True)
    for stage in (int(s) for s in sys.argv[1].split(",")):
        plain = build(stage)
        ref_losses, _ = train(plain, batches)
        cycled = build(stage)
        offloader = DeepSpeedOffloader(cycled)
        losses, stats = train(cycled, batches, offloader)
        same = all(torch.equal(a, b) for a, b in zip(full_params(plain), full_params(cycled)))
        print(
            "RESULT "
            + json.dumps(
                {
                    "stage": stage,
                    "ref_losses": ref_losses,
                    "losses": losses,
                    "same_params": same,
                    "stats": stats,
                    "device_bytes": offloader.device_bytes(),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    assert os.environ.get("MASTER_PORT"), "run through test_offload_deepspeed.py"
    main()
