"""Run by the test_fsdp2_*.py tests through fsdp2_launch.py, one process per rank (gloo, CPU): ``<mode> <dir>``.

A tiny Llama under the FSDP2 engine trains updates of 2 micro-batches per rank on a fixed batch. Modes: ``train``
(next to a non-sharded reference), ``dtypes`` (mixed precision), ``export`` (weights out bucket by bucket),
``offload`` (sleep inside and between updates), ``save`` (a DCP checkpoint mid-run) and ``resume`` (1, 2 or 4
ranks, from that checkpoint). Each rank prints one ``RESULT {json}`` line.
"""

import json
import os
import sys
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

UPDATES, SAVED_AFTER, MICRO, LR = 4, 2, 2, 1e-2


def model(seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config)


def batches() -> list[list[torch.Tensor]]:
    """[rank][micro-batch] token ids for 2 ranks, the same on every process."""
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, 256, (2, 16), generator=g) for _ in range(MICRO)] for _ in range(2)]


def my_batches() -> list[torch.Tensor]:
    """This rank's share of the update's 4 micro-batches: the 2-rank split; one rank takes all of them, each of 4
    ranks one (the same update: the loss and the averaged gradient are means over all 4 micro-batches)."""
    every = [ids for rank in batches() for ids in rank]
    per = len(every) // dist.get_world_size()
    return every[dist.get_rank() * per : (dist.get_rank() + 1) * per]


def warmup(update: int) -> float:
    return min(1.0, (update + 1) / 3)  # a schedule whose position a resumed run must restore


def engine(seed: int, **options):
    from hybrid_algos.train.trainer_backends import FSDP2Engine, FSDP2Options

    opts = FSDP2Options(**{"compute_dtype": None, "reduce_dtype": None, **options})
    return FSDP2Engine.build(model(seed), opts, torch.device("cpu"), lr=LR, max_norm=1.0, lr_lambda=warmup)


def update(eng, mbs: list[torch.Tensor], between=None) -> float:
    """One update over ``mbs`` (this rank's micro-batches); returns the mean micro-batch loss over all ranks."""
    eng.train()
    total = torch.zeros(())
    for i, ids in enumerate(mbs):
        loss = eng(input_ids=ids, labels=ids).loss
        total += loss.detach()
        eng.set_gradient_accumulation_boundary(i == len(mbs) - 1)
        eng.backward(loss / len(mbs))
        if between is not None and i < len(mbs) - 1:
            between()
        eng.step()
    dist.all_reduce(total)
    return float(total) / (len(mbs) * dist.get_world_size())


def reference_losses() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same updates without sharding: one process, every rank's micro-batches in one accumulated update."""
    ref = model(0)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    mbs = [ids for rank in batches() for ids in rank]
    losses = []
    for _ in range(UPDATES):
        total = 0.0
        for ids in mbs:
            loss = ref(input_ids=ids, labels=ids).loss
            total += float(loss)
            (loss / len(mbs)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(total / len(mbs))
    return losses, {k: v.detach().clone() for k, v in ref.named_parameters()}


def local_bytes(eng) -> dict[str, list[bytes]]:
    """Every state's local shard bytes, to compare bit for bit."""
    from torch.distributed.tensor import DTensor

    def raw(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        # a copy: handing the storage itself to numpy would make it unresizable (unfreeable in place)
        return t.detach().clone().contiguous().view(torch.uint8).numpy().tobytes()

    states = [v for s in eng.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {
        "params": [raw(p) for p in eng.module.parameters()],
        "grads": [raw(p.grad) for p in eng.module.parameters() if p.grad is not None],
        "optimizer": [raw(v) for v in states],
    }


def storage_bytes(eng, state: str) -> int:
    from hybrid_core.offload.fsdp2_offload import FSDP2Offloader

    probe = FSDP2Offloader(eng.module, eng.optimizer)  # only to read the sizes; removes its guards at once
    probe.close()
    return probe.device_bytes([state])


def shard_bytes(eng) -> int:
    """The parameter shards' bytes (and the buffers'), counted from FSDP2's own sharded state dict: whatever is
    gathered at the moment, an offload of "params" must move exactly these."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    tensors = [t.to_local() for t in get_model_state_dict(eng.module).values()] + list(eng.module.buffers())
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def export_check(eng, reference: dict[str, torch.Tensor] | None) -> dict:
    """Export with a bucket of 1.5 x the largest tensor, recording every gather as it happens: the gathered bytes
    alive at each gather (in the exporter's buckets or the consumer's hands) make the peak."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    full = get_model_state_dict(eng.module, options=StateDictOptions(full_state_dict=True))
    largest = max(t.numel() * t.element_size() for t in full.values())
    bucket_bytes = 3 * largest // 2
    gathered: list[tuple[weakref.ref, int]] = []
    peak = 0
    original = DTensor.full_tensor

    def observed(self, *args, **kwargs):
        nonlocal peak
        t = original(self, *args, **kwargs)
        gathered.append((weakref.ref(t), t.numel() * t.element_size()))
        peak = max(peak, sum(n for r, n in gathered if r() is not None))
        return t

    names, same, ref_diff = [], True, 0.0
    DTensor.full_tensor = observed
    try:
        for name, t in eng.full_weights(bucket_bytes):
            names.append(name)
            same = same and torch.equal(t, full[name])
            if reference is not None:
                ref_diff = max(ref_diff, float((t - reference[name]).abs().max()))
            del t  # the consumer sends and drops each tensor
    finally:
        DTensor.full_tensor = original
    total = sum(t.numel() * t.element_size() for t in full.values())
    return dict(
        names=names,
        full_names=list(full),
        same=same,
        ref_diff=ref_diff,
        gathers=len(gathered),
        peak=peak,
        bound=bucket_bytes + largest,
        total=total,
    )


def offload_cycles() -> dict:
    """A twin of the plain run that sleeps inside and between its updates; its losses must be bit-identical."""
    from hybrid_core.offload import AsleepError
    from hybrid_core.offload.fsdp2_offload import FSDP2Offloader

    eng = engine(0, activation_checkpointing=True, reshard_after_forward=False)  # layers stay gathered too
    off = FSDP2Offloader(eng.module, eng.optimizer)
    rank_mbs = my_batches()
    out: dict = {"losses": [], "moved": {}, "expected": {}}
    losses = out["losses"]
    losses.append(update(eng, rank_mbs))

    def everything() -> None:  # mid-update: gradients of the first micro-batch exist
        before = local_bytes(eng)
        expected = {s: storage_bytes(eng, s) for s in ("params", "grads", "optimizer")}
        stats = off.offload(["params", "grads", "optimizer"])
        out["moved_all"], out["expected_all"] = stats.bytes, sum(expected.values())
        out["grads_expected"] = expected["grads"]
        out["left_on_device"] = off.device_bytes()
        out["asleep"] = off.asleep and set(off.offloaded) == {"params", "grads", "optimizer"}
        try:
            eng(input_ids=rank_mbs[0])
            out["forward_refused"] = False
        except AsleepError:
            out["forward_refused"] = True
        back = off.reload()
        out["reloaded"] = back.bytes
        out["bit_identical"] = local_bytes(eng) == before

    losses.append(update(eng, rank_mbs, between=everything))
    for states in (["optimizer"], ["params", "grads"]):  # state by state, between updates
        key = "+".join(states)
        with torch.no_grad():  # a log-prob pass first: its units stay gathered after it (reshard_after_forward off)
            eng.eval()(input_ids=rank_mbs[0])
        out["moved"][key] = off.offload(states).bytes  # straight after it: nothing else reshards them first
        out["away_while_" + key] = {s: storage_bytes(eng, s) for s in ("params", "optimizer")}
        off.reload(states)
        sizes = {"params": shard_bytes(eng), "optimizer": storage_bytes(eng, "optimizer")}
        out["expected"][key] = sum(sizes.get(s, 0) for s in states)  # no gradients between updates
        losses.append(update(eng, rank_mbs))
    # the residency plan's value / log-prob phases: only the parameters stay, and a no-gradient pass runs on them
    off.offload(["grads", "optimizer"])
    with torch.no_grad():
        out["no_grad_pass_with_params_only"] = bool(torch.isfinite(eng.eval()(input_ids=rank_mbs[0]).logits).all())
    try:
        eng.train()(input_ids=rank_mbs[0])  # its backward would accumulate into freed gradient shards
        out["training_forward_refused"] = False
    except AsleepError:
        out["training_forward_refused"] = True
    off.reload()
    off.close()
    return out


def dtypes() -> dict:
    """bf16 master: the shards and Adam's moments are bf16; fp32 master with bf16 compute: fp32 shards, bf16 math."""
    out = {}
    ids = batches()[dist.get_rank()][0]
    for name, opts in {
        "bf16_master": dict(master_dtype=torch.bfloat16),
        "bf16_compute": dict(master_dtype=torch.float32, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }.items():
        eng = engine(0, **opts)
        logits = eng(input_ids=ids).logits
        update(eng, [ids])
        p = next(eng.module.parameters())
        moments = {str(v.dtype) for s in eng.optimizer.state.values() for v in s.values() if v.dim() > 0}
        out[name] = dict(
            shard=str(p.to_local().dtype), grad_free=p.grad is None, moments=sorted(moments), logits=str(logits.dtype)
        )
    return out


def train_run() -> dict:
    """(a) 4 updates under FSDP2 (activation checkpointing on) next to the non-sharded reference (rank 0)."""
    from hybrid_algos.train.trainer_backends import TrainingEngine

    eng = engine(0, activation_checkpointing=True)
    rank_mbs = my_batches()
    losses, norms = [], []
    for _ in range(UPDATES):
        losses.append(update(eng, rank_mbs))
        norms.append(eng.get_global_grad_norm())
    out = dict(losses=losses, norms=norms, lr=eng.get_lr(), updates=eng.updates)
    out["protocol"] = isinstance(eng, TrainingEngine)
    if dist.get_rank() == 0:
        out["reference"] = reference_losses()[0]
    return out


def export_run() -> dict:
    """(c) after one update (the shards are no longer the initial weights)."""
    eng = engine(0)
    update(eng, my_batches())
    return export_check(eng, None)


def offload_run() -> dict:
    """(b) the offloaded twin next to a plain run of the same updates."""
    plain = engine(0, activation_checkpointing=True, reshard_after_forward=False)
    out = offload_cycles()
    out["plain_losses"] = [update(plain, my_batches()) for _ in range(UPDATES)]
    out["refusal"] = unfreeable_refused(plain)
    return out


def unfreeable_refused(eng) -> dict:
    """A shard whose memory numpy also holds cannot be freed in place: the offload is refused before any copy."""
    from hybrid_core.errors import HybridError
    from hybrid_core.offload.fsdp2_offload import FSDP2Offloader

    off = FSDP2Offloader(eng.module, eng.optimizer)
    before = off.device_bytes()
    shared = next(eng.module.parameters()).to_local().detach().numpy()  # noqa: F841  (kept: the memory stays shared)
    try:
        off.offload(["optimizer", "params"])
        return {"refused": False}
    except HybridError as e:
        return {
            "refused": "cannot be freed in place" in str(e),
            "kept": off.device_bytes() == before,
            "away": off.offloaded,
        }


def save_run(ckpt: str) -> dict:
    """(d) 4 updates, saved after the second."""
    eng = engine(0)
    losses = []
    for u in range(UPDATES):
        if u == SAVED_AFTER:
            with torch.no_grad():  # a log-prob pass first: FSDP2 keeps the root unit gathered after a forward
                eng.eval()(input_ids=my_batches()[0])
            eng.save_checkpoint(ckpt, "step2")
        losses.append(update(eng, my_batches()))
    return dict(losses=losses, lr_at_save=[LR * warmup(SAVED_AFTER)])


def resume_run(ckpt: str) -> dict:
    """(d) a differently initialised engine, on another rank count, loads the checkpoint and trains the last
    updates on the same micro-batches."""
    eng = engine(7)  # only the checkpoint can make its losses match
    eng.load_checkpoint(ckpt, "step2")
    out = dict(updates=eng.updates, lr_after_load=eng.get_lr())
    out["losses"] = [update(eng, my_batches()) for _ in range(UPDATES - SAVED_AFTER)]
    try:
        eng.load_checkpoint(ckpt, "missing")
    except FileNotFoundError:
        out["missing_refused"] = True
    return out


def main() -> None:
    mode, ckpt = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # every collective times out
    runs = {
        "train": train_run,
        "dtypes": dtypes,
        "export": export_run,
        "offload": offload_run,
        "save": lambda: save_run(ckpt),
        "resume": lambda: resume_run(ckpt),
    }
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(), **runs[mode]()}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()  # no rank tears its group down while a peer is still in a collective
    dist.destroy_process_group()
    # Skip interpreter finalisation: gloo's worker threads can still be joining there and abort the process
    # (SIGABRT, "terminate called without an active exception") after the result is out; seen once in CI.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
