"""Run by test_bf16_optimizer.py in a fresh process (DeepSpeed wants RANK/WORLD_SIZE/MASTER_* and its own dist).

For each case, a tiny Llama in bf16 under the DeepSpeed config the training loop builds (``deepspeed_config``) trains
two updates of two micro-batches each; one JSON line per case says what DeepSpeed really holds: the dtypes of the
master weights and of Adam's moments, whether the weights moved, and the bytes it allocated for the optimizer (on the
"GPU", or in host memory under CPU Adam) next to what the memory model predicts for that mode. With ``cycle``, a twin
engine sleeps and wakes (the trainer's DeepSpeedOffloader: everything, then the optimizer state alone) between its
updates and must end bit-identical to the first.
"""

import gc
import json
import os
import sys
from datetime import timedelta

import torch

P_ALIGN = 1e-3  # DeepSpeed pads each partition to its alignment: a few elements on ~150k parameters


def model_config():
    from transformers import LlamaConfig

    # the embeddings (512 x 64) are the largest parameter, as in a real LM
    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )


def build(stage: int, master: bool, states: bool, offload: bool):
    from transformers import AutoModelForCausalLM

    from hybrid_algos.train.deepspeed_setup import deepspeed_config, make_engine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config()).to(torch.bfloat16)
    config = deepspeed_config(
        zero_stage=stage,
        bf16=True,
        micro_batch=2,
        grad_accum=2,
        lr=1e-2,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        max_norm=1.0,
        adam_offload=offload,
        num_params=sum(p.numel() for p in model.parameters()),
        bf16_master_weights=master,
        bf16_optimizer_states=states,
    )
    return make_engine(model, config), config


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (2, 12), generator=g) for _ in range(4)]  # 2 updates x 2 micro-batches


def train(engine, offloader=None):
    losses = []
    for i, ids in enumerate(batches()):
        if offloader is not None and i == 2:  # between the two updates: the optimizer state exists by then
            offloader.sleep(), offloader.wake()
            offloader.offload(["optimizer"]), offloader.reload()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def full_params(engine):
    import deepspeed

    out = []
    for p in engine.module.parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            out.append(p.detach().clone())
    return out


def storages(*values) -> dict[int, tuple[int, str]]:
    """Distinct storages (so views are counted once) of the tensors in ``values``: ptr -> (bytes, dtype)."""
    out = {}

    def visit(v):
        if isinstance(v, torch.Tensor):
            if v.numel():
                out[v.untyped_storage().data_ptr()] = (v.untyped_storage().nbytes(), str(v.dtype).split(".")[-1])
            if v.grad is not None:
                visit(v.grad)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)

    for v in values:
        visit(v)
    return out


def masters(zero) -> list[torch.Tensor]:
    return list(getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups)


def adam_states(zero) -> list[torch.Tensor]:
    return [v for s in zero.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]


def measure(stage: int, master: bool, states: bool, offload: bool, cycle: bool) -> dict:
    from hybrid_core.offload import DeepSpeedOffloader
    from hybrid_core.residency import Workload, model_shape
    from hybrid_core.residency.memory import cpu_adam_bytes

    engine, config = build(stage, master, states, offload)
    before = full_params(engine)
    losses = train(engine)
    after = full_params(engine)
    zero = engine.optimizer
    shape = model_shape(model_config())
    work = Workload(
        bf16=True,
        zero_stage=stage,
        adam_offload=offload,
        bf16_master_weights=master,
        bf16_optimizer_states=states,
        gradient_accumulation=True,
    )
    out = {
        "case": [stage, master, states, offload],
        "bf16_section": config["bf16"],
        "optimizer": type(zero.optimizer).__name__,
        "params": shape.num_params,
        "master_dtypes": sorted({str(t.dtype).split(".")[-1] for t in masters(zero)}),
        "master_grad_dtypes": sorted({str(t.grad.dtype).split(".")[-1] for t in masters(zero) if t.grad is not None}),
        "adam_dtypes": sorted({str(t.dtype).split(".")[-1] for t in adam_states(zero)}),
        "moved": sum(int((a.float() != b.float()).sum()) for a, b in zip(before, after)),
        "losses": losses,
    }
    if stage == 3:  # the bf16 master partition is a copy of the model's partition, not the same memory
        lp = zero.lp_param_buffer.untyped_storage().data_ptr()
        out["master_aliases_params"] = any(t.untyped_storage().data_ptr() == lp for t in masters(zero))
    if offload:
        # what DeepSpeed keeps in host memory for CPU Adam (every buffer it puts on the offload device)
        held = storages(
            masters(zero),
            getattr(zero, "param_buffer_of_bit16_for_cpu_offload_groups", []),
            getattr(zero, "accumulated_grads_in_cpu", {}),
            getattr(zero, "temp_grad_buffer_for_cpu_offload", None),
            zero.grad_partitions_flat_buffer if stage == 3 else None,
            adam_states(zero),
        )
        out["host_bytes"] = sum(b for b, _ in held.values())
        out["host_predicted"] = cpu_adam_bytes(shape, work, ranks=1)
    else:
        held = storages([t.data for t in masters(zero)], adam_states(zero))
        out["gpu_optimizer_bytes"] = sum(b for b, _ in held.values())
        out["gpu_optimizer_predicted"] = work.optimizer_bytes * shape.num_params
    if cycle:
        twin, _ = build(stage, master, states, offload)
        offloader = DeepSpeedOffloader(twin)
        out["cycled_losses"] = train(twin, offloader)
        out["cycled_same_params"] = all(torch.equal(a, b) for a, b in zip(after, full_params(twin)))
        out["cycled_adam_dtypes"] = sorted({str(t.dtype).split(".")[-1] for t in adam_states(twin.optimizer)})
        out["cycled_master_dtypes"] = sorted({str(t.dtype).split(".")[-1] for t in masters(twin.optimizer)})
        del twin, offloader
    del engine, zero
    gc.collect()
    return out


def main() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120), verbose=False)
    gc.freeze()  # offload_states runs gc.collect() three times; over the whole import heap that costs ~1 s each
    for spec in sys.argv[1:]:  # stage,master,states,offload,cycle (0/1 each)
        stage, master, states, offload, cycle = (int(x) for x in spec.split(","))
        try:
            result = measure(stage, bool(master), bool(states), bool(offload), bool(cycle))
        except Exception as e:  # one case's failure is reported, not the end of the others
            result = {"case": [stage, bool(master), bool(states), bool(offload)], "error": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    assert os.environ.get("MASTER_PORT"), "run through test_bf16_optimizer.py"
    main()
