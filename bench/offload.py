"""Offload / reload of a role's state: hybrid's StateOffloader vs DeepSpeed ZeRO-3 offload_states, vs the PCIe limit.

The role mirrors a mixed-precision trainer: a ~1B Llama (hidden 2048, 16 layers, intermediate 5632, vocab 32000)
with bf16 parameters, an fp32 master copy and AdamW moments (~13.35 GB in all), after one optimizer step.
Measured in the same run: the pinned host<->device copy rate, our sleep/wake cycles (first and steady), the GPU
memory left while asleep, and DeepSpeed's offload_states/reload_states on the same model (ZeRO-3, world size 1).

    python bench/offload.py                 # GPU (the lent H100)
    python bench/offload.py --record        # ... and append the rows to bench/RESULTS.md
    python bench/offload.py --small         # tiny model on CPU: checks the logic, numbers mean nothing
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback

import torch

from _common import Row, append_results, build_llama, device_label, free_port, print_table


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model (runs on CPU)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--cycles", type=int, default=6, help="sleep/wake cycles of ours (the first is reported apart)")
    ap.add_argument("--ds-cycles", type=int, default=3, help="DeepSpeed offload/reload cycles")
    ap.add_argument("--chunk-mb", type=int, default=256, help="copy chunk size of StateOffloader")
    ap.add_argument("--copy-gb", type=float, default=4.0, help="size of the raw pinned-copy measurement")
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md")
    return ap.parse_args()


# ---- the physical limit --------------------------------------------------------------------------------------------
def copy_rates(device: torch.device, nbytes: int, reps: int = 5) -> tuple[float, float]:
    """GB/s of plain device->host and host->device copies of ``nbytes`` between pinned host and device memory."""
    pin = device.type == "cuda"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev.fill_(1)

    def timed(dst, src) -> float:
        best = float("inf")
        for _ in range(reps + 1):  # the first is a warm-up
            _sync(device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            _sync(device)
            best = min(best, time.perf_counter() - t)
        return nbytes / best / 1e9

    rates = timed(host, dev), timed(dev, host)
    del dev, host
    _release(device)
    return rates


# ---- ours ----------------------------------------------------------------------------------------------------------
def make_role(small: bool, device: torch.device):
    """bf16 model + fp32 master params + AdamW state after one step (grads dropped, as after optimizer.zero_grad)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_llama(small, device, dtype)
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=1e-4)
    for p in master:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, m in zip(model.parameters(), master):
            p.copy_(m)
    return model, master, opt


def state_tensors(model, master, opt) -> list[torch.Tensor]:
    """Every device tensor of the role (what must come back bit-exactly)."""
    adam = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    return list(model.parameters()) + list(model.buffers()) + master + adam


_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensors) -> list[tuple[int, int]]:
    """Per-tensor digests of the raw bits (integer sums: exact and order-independent), computed on the device."""
    out = []
    for t in tensors:
        words = t.detach().contiguous().view(-1).view(_WORD[t.element_size()]).to(torch.int64)
        out.append((int(words.sum()), int((words * words).sum())))
        del words
    return out


def bench_ours(args, device: torch.device, rows: list[Row], pcie: tuple[float, float]) -> None:
    from hybrid_core.offload import StateOffloader

    model, master, opt = make_role(args.small, device)
    tokens = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        logits_before = model(tokens).logits.float().cpu()
    digest_before = fingerprint(state_tensors(model, master, opt))
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(model, master, opt))
    print(
        f"role state: {nbytes / 1e9:.2f} GB ({sum(p.numel() for p in model.parameters()) / 1e9:.3f} B params)",
        flush=True,
    )
    _release(device)
    awake = _footprint(device, model, master, opt)

    t = time.perf_counter()
    off = StateOffloader(model, opt, chunk_bytes=args.chunk_mb << 20)
    construct_s = time.perf_counter() - t
    sleeps, wakes, asleep = [], [], []
    for i in range(args.cycles):
        s = off.sleep()
        asleep.append(_footprint(device, model, master, opt))
        w = off.wake()
        sleeps.append(s)
        wakes.append(w)
        print(
            f"cycle {i}: sleep {s.bytes / 1e9:.2f} GB in {s.seconds:.3f} s ({s.gbps:.1f} GB/s), "
            f"wake {w.seconds:.3f} s ({w.gbps:.1f} GB/s), asleep footprint {asleep[-1]} B",
            flush=True,
        )
    with torch.no_grad():
        exact_logits = torch.equal(model(tokens).logits.float().cpu(), logits_before)
    exact_state = fingerprint(state_tensors(model, master, opt)) == digest_before
    if not (exact_logits and exact_state):
        raise AssertionError(f"state changed across cycles: logits exact {exact_logits}, state exact {exact_state}")
    print("bit-exact after all cycles: logits and every parameter / master / Adam tensor", flush=True)

    steady = range(1, len(sleeps))
    off_gbps = statistics.median(sleeps[i].gbps for i in steady)
    on_gbps = statistics.median(wakes[i].gbps for i in steady)
    cycle = [s.seconds + w.seconds for s, w in zip(sleeps, wakes)]
    rows += [
        Row("offload GB/s", off_gbps, "GB/s (steady median, StateOffloader)"),
        Row("reload GB/s", on_gbps, "GB/s (steady median, StateOffloader)"),
        Row("first/steady cycle ratio", cycle[0] / statistics.median(cycle[i] for i in steady), "x (sleep+wake)"),
        Row(
            "asleep GPU footprint %",
            100.0 * max(asleep) / awake if awake else 0.0,
            "% of awake (torch reserved)" if device.type == "cuda" else "% of awake (state bytes held)",
        ),
        Row("offload GB/s (first cycle)", sleeps[0].gbps, "GB/s", record=False),
        Row("reload GB/s (first cycle)", wakes[0].gbps, "GB/s", record=False),
        Row("offload / pinned D2H copy", 100.0 * off_gbps / pcie[0], "% (target >= 90)", record=False),
        Row("reload / pinned H2D copy", 100.0 * on_gbps / pcie[1], "% (target >= 90)", record=False),
        Row(
            "host buffer allocation (pinning)",
            off.host_alloc.seconds,
            f"s for {off.host_alloc.bytes / 1e9:.2f} GB",
            record=False,
        ),
        Row("StateOffloader construction", construct_s, "s", record=False),
        Row("state moved per cycle", sleeps[-1].bytes / 1e9, "GB", record=False),
    ]
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        rows.append(
            Row("device memory in use after wake (incl. CUDA context)", (total - free) / 1e9, "GB", record=False)
        )
    off.close()
    del model, master, opt, off
    _release(device)


def _footprint(device: torch.device, model, master, opt) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_reserved(device)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state_tensors(model, master, opt)}
    return sum(storages.values())


# ---- DeepSpeed -----------------------------------------------------------------------------------------------------
def bench_deepspeed(args, device: torch.device, rows: list[Row]) -> None:
    try:
        import deepspeed
    except ImportError:
        print("DeepSpeed is not installed: skipping its rows", flush=True)
        return
    from datetime import timedelta

    from hybrid_core.offload import DeepSpeedOffloader

    if device.type == "cuda" and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        major, minor = torch.cuda.get_device_capability(device)
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"  # FusedAdam's JIT build: only this GPU's arch
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    os.environ.pop("LOCAL_WORLD_SIZE", None)  # on CPU it sends DeepSpeed down a ~10x slower path
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(
        dist_backend="nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=300), verbose=False
    )
    bf16 = device.type == "cuda"
    model = build_llama(args.small, device, torch.bfloat16 if bf16 else torch.float32)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    t = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    print(f"DeepSpeed engine ready in {time.perf_counter() - t:.1f} s", flush=True)
    tokens = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).to(device)
    loss = engine(tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    _release(device)
    off = DeepSpeedOffloader(engine)
    sleeps, wakes = [], []
    for i in range(args.ds_cycles):
        s = off.sleep()
        w = off.wake()
        sleeps.append(s)
        wakes.append(w)
        print(
            f"DeepSpeed cycle {i}: offload {s.bytes / 1e9:.2f} GB in {s.seconds:.3f} s ({s.gbps:.1f} GB/s), "
            f"reload {w.seconds:.3f} s ({w.gbps:.1f} GB/s)",
            flush=True,
        )
    steady = range(1, len(sleeps)) if len(sleeps) > 1 else range(len(sleeps))
    # Rates over the same role state as ours (bf16 params + fp32 master + Adam moments: 14 bytes/param). DeepSpeed's
    # own byte count also lists buffers it frees and re-allocates without copying (its gradient buffers): dividing
    # that by the time gave a reload above the PCIe limit on the H100 (71 GB/s > 55 GB/s), i.e. not a copy rate.
    state_bytes = 14 * sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    rows += [
        Row(
            "DeepSpeed offload GB/s",
            state_bytes / 1e9 / statistics.median(sleeps[i].seconds for i in steady),
            f"GB/s ({state_bytes / 1e9:.2f} GB role state / ZeRO-3 offload_states time, steady median)",
        ),
        Row(
            "DeepSpeed reload GB/s",
            state_bytes / 1e9 / statistics.median(wakes[i].seconds for i in steady),
            f"GB/s ({state_bytes / 1e9:.2f} GB role state / ZeRO-3 reload_states time, steady median)",
        ),
        Row(
            "DeepSpeed bytes it reports per cycle",
            sleeps[-1].bytes / 1e9,
            "GB (incl. freed-only buffers)",
            record=False,
        ),
        Row("DeepSpeed first offload", sleeps[0].seconds, "s (includes its host pinning)", record=False),
    ]
    del engine, model, off
    _release(device)


# ---- helpers -------------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()  # give cached pinned host memory back between sections


def main() -> int:
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    label = device_label(device)
    print(f"device: {label}; torch {torch.__version__}", flush=True)
    failed = []
    nbytes = int((0.05 if args.small else args.copy_gb) * (1 << 30))
    d2h, h2d = copy_rates(device, nbytes)
    what = "pinned" if device.type == "cuda" else "host memcpy, no PCIe"
    limit = [
        Row("pinned PCIe copy GB/s", d2h, f"GB/s device->host ({what})"),
        Row("pinned PCIe copy GB/s", h2d, f"GB/s host->device ({what})"),
    ]
    suffix = " (--small: logic check only)" if args.small else ""
    sections = [("StateOffloader", lambda rows: bench_ours(args, device, rows, (d2h, h2d)))]
    if not args.skip_deepspeed:
        sections.append(("DeepSpeed", lambda rows: bench_deepspeed(args, device, rows)))
    for i, (name, section) in enumerate(sections):
        rows: list[Row] = list(limit) if i == 0 else []
        try:
            section(rows)
        except Exception:  # keep the other section's numbers; report and fail at the end
            traceback.print_exc()
            failed.append(name)
            _release(device)
        # printed and recorded section by section, so a later section that crashes or hangs loses nothing
        print_table(f"{name}: offload / reload on {label}{suffix}", rows)
        if args.record and rows:
            print(f"appended {append_results(rows, label)} rows to bench/RESULTS.md", flush=True)
    if failed:
        print(f"FAILED sections: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
