"""Run by test_update_guard.py in a fresh process (DeepSpeed wants RANK/WORLD_SIZE/MASTER_* and its own dist).

Per ZeRO stage, a tiny Llama in bf16 under the training loop's DeepSpeed config, stepped through ``UpdateGuard``
(two micro-batches per update) in three cases: clean updates; a NaN loss in an update's second micro-batch; an inf
gradient under finite losses. One JSON line per case: what was raised, whether the weights moved, and whether
DeepSpeed's own per-tensor overflow scan was off.
"""

import json
import os
import sys
from datetime import timedelta

import torch
from bf16_optimizer_worker import full_params as weights  # this folder: the script's sys.path[0]


def build(stage: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybrid_algos.train.deepspeed_setup import deepspeed_config, make_engine

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).to(torch.bfloat16)
    config = deepspeed_config(
        zero_stage=stage,
        bf16=True,
        micro_batch=2,
        grad_accum=2,
        lr=1e-2,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        max_norm=1.0,
        adam_offload=False,
        num_params=sum(p.numel() for p in model.parameters()),
    )
    return make_engine(model, config)


def run(stage: int, case: str) -> dict:
    from hybrid_algos.train.update_guard import NonFiniteUpdate, UpdateGuard

    engine = build(stage)
    guard = UpdateGuard("actor", 0)
    g = torch.Generator().manual_seed(1)
    before = weights(engine)
    raised, steps = None, 0
    try:
        for i in range(4):  # 2 updates x 2 micro-batches
            ids = torch.randint(0, 256, (2, 8), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss
            if case == "nan_loss" and i == 1:
                loss = loss * float("nan")
            guard.add_loss(loss)
            if case == "inf_grad" and i == 1:  # finite loss, one gradient overflows on the way back
                next(engine.module.parameters()).register_hook(lambda grad: grad * float("inf"))
            engine.backward(loss)
            guard.step(engine, step=0)
            steps += 1
    except NonFiniteUpdate as e:
        raised = str(e)
    after = weights(engine)
    scan = getattr(engine.optimizer, "check_grad_overflow", None)
    return {
        "stage": stage,
        "case": case,
        "raised": raised,
        "micro_steps_done": steps,
        "moved": any(not torch.equal(a, b) for a, b in zip(before, after)),
        "deepspeed_scan": scan,
    }


def main() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120), verbose=False)
    for spec in sys.argv[1:]:
        stage, case = spec.split(",")
        try:
            result = run(int(stage), case)
        except Exception as e:
            result = {"stage": int(stage), "case": case, "error": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    assert os.environ.get("MASTER_PORT"), "run through test_update_guard.py"
    main()
