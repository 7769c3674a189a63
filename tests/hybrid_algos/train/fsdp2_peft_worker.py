"""Run by test_fsdp2_peft.py through fsdp2_launch.py, one process per rank (gloo, CPU): ``<backend> <dir>``.

A tiny Llama wrapped by ``peft.get_peft_model`` (LoRA on q_proj and v_proj) is built into a trained role's engine by
the trainer-backend registry, as the actor's setup builds it, and trains 4 updates of 2 micro-batches per rank. Then
its states sleep and wake, the log-prob pass the actor uses runs on it, and its full weights are exported and saved
in Hugging Face format. Each rank prints one ``RESULT {json}`` line.
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from fsdp2_worker import UPDATES, local_bytes, model, my_batches, update

RANK_R, ALPHA = 4, 16  # LoRA's scaling: ALPHA / RANK_R = 4
TARGETS = ("q_proj", "v_proj")


def peft_model():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model(0), LoraConfig(r=RANK_R, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0)
    )


def full_state(eng) -> dict[str, torch.Tensor]:
    """Every parameter full, by the PEFT model's own names (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True)
    return {k: v.detach().clone() for k, v in get_model_state_dict(eng.module, options=options).items()}


def expected_merge(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """W + (alpha / r) * B @ A for every adapted layer, computed here from the PEFT model's full parameters, under
    the base model's names; every other parameter as it is."""
    out = {}
    for name, t in state.items():
        if ".lora_" in name:
            continue
        hf = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if ".base_layer.weight" in name:
            layer = name.removesuffix(".base_layer.weight")
            a, b = state[f"{layer}.lora_A.default.weight"], state[f"{layer}.lora_B.default.weight"]
            t = t + (ALPHA / RANK_R) * (b @ a)
        out[hf] = t
    return out


def logprob_gap(eng) -> float:
    """The actor's chunked log-prob pass (models.response_token_scores) through the PEFT model against its own
    full logits."""
    from hybrid_algos.train.models import response_logprobs

    ids = my_batches()[0]
    mask = torch.ones_like(ids)
    eng.eval()
    with torch.no_grad():
        chunked = response_logprobs(eng, ids, mask, 8)
        logits = eng(input_ids=ids).logits[:, -9:-1].float()
    full = logits.log_softmax(-1).gather(-1, ids[:, -8:, None]).squeeze(-1)
    return float((chunked - full).abs().max())


def base_gaps(eng) -> tuple[float, float]:
    """The reference under LoRA (PolicyWorker.base_logprobs): the engine's forward with its adapters off against the
    untouched base model's, and with them on (trained: apart)."""
    ids = my_batches()[0]
    eng.eval()
    with torch.no_grad():
        want = model(0).eval()(input_ids=ids).logits
        with eng.module.disable_adapter():
            off = eng(input_ids=ids).logits
        on = eng(input_ids=ids).logits
    return float((off - want).abs().max()), float((on - want).abs().max())


def run(backend: str, folder: str) -> dict:
    from transformers import AutoModelForCausalLM

    from hybrid_algos.train.trainer_backends.peft_weights import hf_model
    from hybrid_algos.train.trainer_backends.registry import make_offloader, make_training_engine
    from hybrid_algos.train.workers.settings import TrainerSettings

    trainer = TrainerSettings(backend=backend, zero_stage=2 if backend == "fsdp2" else 3, max_grad_norm=1.0)
    shape = {"micro_batch": 2, "grad_accum": 2, "total_updates": UPDATES}
    wrapped = peft_model()
    trainable = sorted(n for n, p in wrapped.named_parameters() if p.requires_grad)
    eng = make_training_engine(trainer, wrapped, 1e-2, shape, torch.device("cpu"))
    before = full_state(eng) if backend == "fsdp2" else None
    out: dict = {"trainable": trainable, "losses": [update(eng, my_batches()) for _ in range(UPDATES)]}

    if backend == "fsdp2":
        after = full_state(eng)
        names = {id(p): n for n, p in eng.module.named_parameters()}
        out["optimizer_params"] = sorted(names[id(p)] for p in eng.optimizer.state)
        out["changed"] = sorted(n for n in after if not torch.equal(after[n], before[n]))
        out["frozen_identical"] = all(torch.equal(after[n], before[n]) for n in after if ".lora_" not in n)
        # sleep and wake every state between updates: bit-identical, and a forward while asleep is refused
        off = make_offloader(trainer, eng)
        shards = local_bytes(eng)
        off.offload(["params", "grads", "optimizer"])
        try:
            eng(input_ids=my_batches()[0])
            out["asleep_forward_refused"] = False
        except Exception as e:  # noqa: BLE001 -- the test checks which
            out["asleep_forward_refused"] = type(e).__name__ == "AsleepError"
        off.reload()
        out["round_trip_identical"] = local_bytes(eng) == shards
        out["loss_after_wake"] = update(eng, my_batches())
        expected = expected_merge(full_state(eng))
    out["logprob_gap"] = logprob_gap(eng)
    out["base_gap"], out["adapted_gap"] = base_gaps(eng)

    exported = {n: t.detach().clone() for n, t in eng.full_weights(1 << 12)}  # small buckets: many of them
    out["export_names"] = list(exported)
    out["meta_names"] = [n for n, _, _ in eng.weight_metas()]
    out["meta_shapes_match"] = all(tuple(exported[n].shape) == s for n, _, s in eng.weight_metas())
    out["plain_names"] = [n for n, _ in model(0).named_parameters()]
    # adapter-only sync: the adapter's tensors alone, gathered full, under PEFT's saved-adapter names; with the
    # untouched base they give the merged export back (W + scale * B @ A)
    from hybrid_algos.train.trainer_backends.peft_weights import adapter_metas, adapter_names, adapter_weights

    names = adapter_names(eng.module)
    dtype = getattr(eng, "weights_dtype", None)
    sent = {n: t.detach().clone() for n, t in adapter_weights(eng.module, names, dtype)}
    out["adapter_names"] = sorted(sent)
    out["adapter_metas_match"] = [(n, tuple(s)) for n, _, s in adapter_metas(eng.module, names, dtype)] == [
        (n, tuple(t.shape)) for n, t in sent.items()
    ]
    base = dict(model(0).named_parameters())
    gaps = []
    for wire, a in sent.items():
        if ".lora_A." in wire:
            layer = wire.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = sent[wire.replace(".lora_A.", ".lora_B.")]
            want = base[f"{layer}.weight"].detach() + (ALPHA / RANK_R) * (b @ a)
            gaps.append(float((exported[f"{layer}.weight"] - want).abs().max()))
    out["adapter_merge_gap"] = max(gaps)
    if backend == "fsdp2":
        out["merge_gap"] = max(float((exported[n] - expected[n]).abs().max()) for n in expected)
        out["unadapted_identical"] = all(
            torch.equal(exported[n], expected[n]) for n in expected if not any(t in n for t in TARGETS)
        )
    # the merged weights in a plain model compute what the PEFT model computes
    plain = model(7).eval()
    plain.load_state_dict(exported, strict=True)
    ids = my_batches()[0]
    eng.eval()
    with torch.no_grad():
        out["plain_vs_peft_logits"] = float((plain(input_ids=ids).logits - eng(input_ids=ids).logits).abs().max())
    # ... and in a Hugging Face folder (rank 0 writes, as PolicyWorker.save_pretrained does)
    if dist.get_rank() == 0:
        hf_model(eng.module).save_pretrained(folder, state_dict=exported)
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            saved_gap = (loaded(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max()
        out["saved_vs_peft_logits"] = float(saved_gap)
        out["saved_files"] = sorted(os.listdir(folder))
    return out


def main() -> None:
    backend, folder = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if backend == "deepspeed":  # takes the group made here, as deepspeed_setup.init_distributed does
        import deepspeed

        os.environ["LOCAL_RANK"] = "0"
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60), verbose=False)
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(), **run(backend, folder)}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()  # no rank tears its group down while a peer is still in a collective
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort at interpreter exit (see fsdp2_worker.main)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
