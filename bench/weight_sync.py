"""Weight sync of the ~1B Llama in bf16 (1.9 GB) from a trainer process to an engine process.

* ipc: sender and engine share one GPU; flat buckets are handed over by CUDA IPC handle (``IpcBucketSender``), the
  engine copies them into its own model. Metric ``weight sync GB/s``.
* nccl: sender on GPU 0, engine on GPU 1, a dedicated NCCL group (``WeightSender`` / ``WeightReceiver``). Metric
  ``weight sync NCCL GB/s``. Runs when two GPUs are visible.

Each mode runs several syncs; the first (mapping handles, building the communicator) is reported apart, the rate
is the median of the others. After the last sync the engine's weights are checked bit-exact against the sender's.

Verification (checksums of the checked pieces, ``hybrid_core.weight_sync.verify``, read back from the engine's
parameters; which pieces: ``hybrid_core.weight_sync.sampling``): after the first sync (a run's first: every piece),
the rounds cycle through ``sampled`` (the default: a rotating 1/32 of the pieces), unverified and ``full`` (every
piece) syncs; metrics ``weight sync verify overhead %`` (sampled) and ``weight sync verify overhead full %`` =
(median verified - median unverified) / median unverified. Then one ``full`` sync with a byte flipped in flight at
the engine (``HYBRID_FAULT=receiver:bucket:corrupt:2``) must fail naming the parameter. The checksum path of each
side's device (``torch._int_mm`` or the reductions that stand in for it) is printed.

    python bench/weight_sync.py [--record]     # GPU(s)
    python bench/weight_sync.py --small        # tiny model on CPU (shared memory + gloo): logic check only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

from _common import Row, append_results, build_llama, device_label, free_port, print_table


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model on CPU")
    ap.add_argument(
        "--size",
        choices=("1b", "7b"),
        default="1b",
        help="the model synced: the ~1B Llama (1.9 GB in bf16, the rows' default) or a 6.7B one (13.5 GB; rows "
        "named ... 7B %%)",
    )
    ap.add_argument(
        "--mode",
        choices=("auto", "ipc", "nccl", "both"),
        default="auto",
        help="auto: ipc, plus nccl when 2 GPUs are visible (on CPU both run, the second over gloo)",
    )
    ap.add_argument("--bucket-mb", type=float, default=None, help="default 512 (GPU), 1/32 with --small")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="syncs: 1 warm-up, then sampled / unverified / full in turn (default: three rotations of the sampled "
        "groups, the first reported apart)",
    )
    ap.add_argument("--timeout", type=float, default=300, help="seconds for any one wait")
    ap.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md")
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of a late sampled sync, both sides")
    ap.add_argument("--verbose", action="store_true", help="print each round's split (engine, sender checksums)")
    ap.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="with --profile: also write each profiled sync's Chrome trace (both sides) to DIR (the timeline shows "
        "where a checked sync waits)",
    )
    ap.add_argument(
        "--mps",
        action="store_true",
        help="run both processes under a CUDA MPS control daemon of the bench's own (hybrid_core.mps_daemon; its "
        "kernels may then overlap instead of time-slicing the GPU); the rows get ' MPS' in their names",
    )
    return ap.parse_args()


def fingerprint(model) -> list[tuple[int, int]]:
    out = []
    for p in model.parameters():
        words = p.detach().contiguous().view(-1).view(torch.int16 if p.element_size() == 2 else torch.int32)
        words = words.to(torch.int64)
        out.append((int(words.sum()), int((words * words).sum())))
    return out


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


# ---- the engine processes ------------------------------------------------------------------------------------------
def _corrupt_next(nth: int) -> None:
    """In the engine process: flip a byte of the nth bucket received from now on (the fault counter restarts)."""
    import os

    from hybrid_core import faults

    os.environ[faults.ENV] = f"receiver:bucket:corrupt:{nth}"
    faults._calls.clear()


def _clear_fault() -> None:
    import os

    from hybrid_core import faults

    os.environ.pop(faults.ENV, None)


def _activities(device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    return [*acts, torch.profiler.ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else acts


def _print_profile(title: str, prof, trace_dir: str | None = None) -> None:
    """The ops of one profiled sync by CPU time and, on a GPU, by CUDA time (what verification adds shows against the
    unverified sync's tables); with ``trace_dir`` its Chrome trace too."""
    if trace_dir:
        import os

        os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir, "ws_trace_" + title.replace(", ", "_").replace(" ", "_") + ".json")
        prof.export_chrome_trace(path)
        print(f"== trace: {path}", flush=True)
    table = prof.key_averages()
    print(f"== profile: {title}, by CPU time\n{table.table(sort_by='cpu_time_total', row_limit=14)}", flush=True)
    if any(getattr(e, "device_time_total", 0) for e in table):
        print(f"== profile: {title}, by device time\n{table.table(sort_by='self_device_time_total', row_limit=10)}")


def ipc_engine(shape: tuple[bool, str], device: str, requests, replies, trace_dir: str | None = None) -> None:
    """Holds its own model on the same device; loads IPC buckets into it (verified against its parameters) and
    acknowledges each."""
    from hybrid_core.errors import WeightSyncMismatch
    from hybrid_core.weight_sync import load_ipc_bucket

    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        torch.manual_seed(1)  # different weights than the sender's until synced
        model = build_llama(*shape[:1], dev, _dtype(dev), size=shape[1])
        params = dict(model.named_parameters())
        busy: list[float] = []

        def load(pairs):
            with torch.no_grad():
                for name, tensor in pairs:
                    params[name].copy_(tensor)

        replies.put(("ready", None))
        while (msg := requests.get(timeout=600)) is not None:
            if msg == "fingerprint":
                replies.put(("fingerprint", fingerprint(model)))
            elif isinstance(msg, tuple) and msg[0] == "profile":  # --profile: the engine's side of a sync
                if msg[1]:
                    prof = torch.profiler.profile(activities=_activities(dev))
                    prof.__enter__()
                else:
                    prof.__exit__(None, None, None)
                    _print_profile(f"engine, {msg[2]} sync", prof, trace_dir)
                replies.put(("ok", None))
            elif msg == "busy":  # seconds spent in load_ipc_bucket since the last ask (the engine's share of a sync)
                replies.put(("busy", sum(busy)))
                busy.clear()
            elif msg == "path":
                replies.put(("path", _path(dev)))
            elif isinstance(msg, tuple) and msg[0] == "corrupt":
                _corrupt_next(msg[1])
                replies.put(("ok", None))
            else:
                try:
                    start = time.perf_counter()
                    load_ipc_bucket(msg, load, lambda name: params.get(name))
                    busy.append(time.perf_counter() - start)
                    replies.put(("ack", msg.index))
                except WeightSyncMismatch as e:
                    _clear_fault()
                    replies.put(("mismatch", str(e)))
    except BaseException:
        replies.put(("error", traceback.format_exc()))


def group_engine(
    shape: tuple[bool, str], device: str, port: int, backend: str, bucket_bytes: int, timeout: float, requests, replies
) -> None:
    """Rank 1 of a sync group: receives broadcast buckets into its own model on its own device (verified against
    its parameters when the sender sends checksums)."""
    from hybrid_core.errors import WeightSyncMismatch
    from hybrid_core.weight_sync import WeightReceiver, create_sync_group

    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        torch.manual_seed(1)
        model = build_llama(*shape[:1], dev, _dtype(dev), size=shape[1])
        params = dict(model.named_parameters())
        group = create_sync_group("127.0.0.1", port, 1, 2, backend=backend, timeout_s=timeout, device=dev)
        receiver = WeightReceiver(group, bucket_bytes, device=dev)

        def load(pairs):
            with torch.no_grad():
                for name, tensor in pairs:
                    params[name].copy_(tensor)

        while (msg := requests.get(timeout=600)) is not None:
            if msg == "fingerprint":
                replies.put(("fingerprint", fingerprint(model)))
            elif msg == "path":
                replies.put(("path", _path(dev)))
            elif isinstance(msg, tuple) and msg[0] == "corrupt":
                _corrupt_next(msg[1])
                replies.put(("ok", None))
            else:
                try:
                    stats = receiver.receive(msg, load, lambda name: params.get(name))
                    replies.put(("received", stats.as_dict()))
                except WeightSyncMismatch as e:
                    _clear_fault()
                    replies.put(("mismatch", str(e)))
        group.close()
    except BaseException:
        replies.put(("error", traceback.format_exc()))


def _reply(replies, kind: str, timeout: float):
    got, value = replies.get(timeout=timeout)
    return _check_kind(got, value, kind)


def _check_kind(got: str, value, kind: str):
    if got == "error":
        raise RuntimeError(f"engine process failed:\n{value}")
    if got != kind:
        raise RuntimeError(f"engine process answered {got!r}, expected {kind!r}")
    return value


# ---- the two modes -------------------------------------------------------------------------------------------------
class _SenderChecksumTimes(list):
    """The sender's checksum calls, for the split of the cost: on a GPU, CUDA events around each call (kernels
    included) read after the sync, so timing them does not put them on the sync's path (a synchronize would: the
    sender launches them after the hand-over); on the CPU, the wall time of each call."""

    def __init__(self):
        super().__init__()
        self.events: list = []

    def settle(self) -> None:
        for start, end in self.events:
            end.synchronize()
            self.append(start.elapsed_time(end) / 1e3)
        self.events.clear()

    def clear(self) -> None:
        super().clear()
        self.events.clear()


def _time_sender_checksums() -> _SenderChecksumTimes:
    from hybrid_core.weight_sync import ipc

    spent = _SenderChecksumTimes()
    inner = ipc.bucket_checksums

    def timed(buffer, pieces):
        if not buffer.is_cuda:
            start = time.perf_counter()
            out = inner(buffer, pieces)
            spent.append(time.perf_counter() - start)
            return out
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_event.record()
        out = inner(buffer, pieces)
        end_event.record()
        spent.events.append((start_event, end_event))
        return out

    ipc.bucket_checksums = timed
    return spent


def bench_ipc(args, device: torch.device, rows: list[Row]) -> None:
    from hybrid_core.weight_sync import IpcBucketSender

    model = build_llama(args.small, device, _dtype(device), size=args.size)
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(
        target=ipc_engine, args=((args.small, args.size), str(device), requests, replies, args.trace), daemon=True
    )
    engine.start()
    try:
        _reply(replies, "ready", args.timeout)
        sender = IpcBucketSender(bucket_bytes=int(args.bucket_mb * (1 << 20)), device=device)
        acked: set[int] = set()

        def deliver(bucket):
            requests.put(bucket)
            return bucket.index

        def wait(index):
            while index not in acked:
                acked.add(_reply(replies, "ack", args.timeout))

        rates, times = [], {mode: [] for mode in MODES}
        engine_busy: dict[str, list[float]] = {mode: [] for mode in MODES}
        sender_profile: list = []
        from hybrid_core.weight_sync.sampling import PERIOD

        first: dict[str, list[float]] = {mode: [] for mode in MODES}
        warm = len(MODES) * PERIOD if args.rounds > 1 + 2 * len(MODES) * PERIOD else 0

        sender_sums = _time_sender_checksums()
        for r in range(args.rounds):
            acked.clear()
            mode, sender.verify = policy(r)
            # a late sampled sync and the unverified one after it, CPU and CUDA time, each side
            profiling = args.profile and mode != "full" and len(MODES) * (PERIOD + 3) < r <= len(MODES) * (PERIOD + 4)
            if profiling:
                requests.put(("profile", True))
                _reply(replies, "ok", args.timeout)
                prof = torch.profiler.profile(activities=_activities(device))
                prof.__enter__()
            sender_sums.clear()
            start = time.perf_counter()
            stats = sender.send(model.named_parameters(), deliver, wait)
            seconds = time.perf_counter() - start
            sender_sums.settle()
            if profiling:
                prof.__exit__(None, None, None)
                sender_profile.append((mode, prof))
                requests.put(("profile", False, mode))
                _reply(replies, "ok", args.timeout)
            requests.put("busy")
            busy = _reply(replies, "busy", args.timeout)
            if args.verbose:
                print(
                    f"round {r} {mode}: {seconds * 1e3:.2f} ms, engine {busy * 1e3:.2f} ms, sender checksums "
                    f"{sum(sender_sums) * 1e3:.2f} ms in {len(sender_sums)} calls",
                    flush=True,
                )
            # the first rotation of the sampled groups builds each group's checksum tables (once a run): apart
            if r:
                (first if r <= warm else times)[mode].append(seconds)
            if r > warm:
                engine_busy[mode].append(busy)
                engine_busy.setdefault(mode + " sender checksums", []).append(sum(sender_sums))
            if mode != "off":
                rates.append(stats.bytes / seconds / 1e9)
            print(
                f"ipc sync {r} ({describe(sender.verify)}): {stats.bytes / 1e9:.3f} GB in "
                f"{seconds * 1e3:.1f} ms ({stats.bytes / seconds / 1e9:.1f} GB/s)",
                flush=True,
            )
        for mode, prof in sender_profile:
            _print_profile(f"sender, {mode} sync", prof, args.trace)
        for mode, values in engine_busy.items():
            what = mode if "sender" in mode else f"{mode} engine load_ipc_bucket"
            print(f"{what}: median {statistics.median(values) * 1e3:.2f} ms a sync", flush=True)
        requests.put("fingerprint")
        exact = _reply(replies, "fingerprint", args.timeout) == fingerprint(model)
        requests.put("path")
        paths = f"checksums: sender {_path(device)}, engine {_reply(replies, 'path', args.timeout)}"
        print(f"ipc {paths}", flush=True)
        sender.verify = "full"
        requests.put(("corrupt", 2))
        _reply(replies, "ok", args.timeout)
        acked.clear()
        caught = None

        def wait_or_mismatch(index):
            nonlocal caught
            while index not in acked and caught is None:
                got, value = replies.get(timeout=args.timeout)
                if got == "mismatch":
                    caught = value
                    raise RuntimeError(value)
                acked.add(_check_kind(got, value, "ack"))

        try:
            sender.send(model.named_parameters(), deliver, wait_or_mismatch)
        except RuntimeError:
            pass
        requests.put(None)
        sender.close()
    finally:
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    if not exact:
        raise AssertionError("the engine's weights differ from the sender's after the IPC syncs")
    print("ipc: engine weights bit-exact", flush=True)
    _check_caught("ipc", caught)
    what = "CUDA IPC buckets" if device.type == "cuda" else "shared-memory buckets, CPU"
    what += ", both processes under CUDA MPS" if args.mps else ""
    what += ", 6.7B Llama, 13.5 GB" if args.size == "7b" else ""
    rows += [
        Row(
            "weight sync" + (" 7B" if args.size == "7b" else "") + (" MPS" if args.mps else "") + " GB/s",
            statistics.median(rates[1:] or rates),
            f"GB/s ({what}, {args.bucket_mb:g} MB, median, verified)",
        ),
        Row("weight sync GB/s (first sync)", rates[0], "GB/s (maps the handles)", record=False),
        *overhead_rows(times, what, args, paths),
    ]
    if first["sampled"]:
        pct = (statistics.mean(first["sampled"]) / statistics.mean(first["off"]) - 1) * 100
        print(f"verify sampled, first rotation (tables built): {pct:+.2f} % (not in the rows above)", flush=True)
        rows.append(Row("weight sync verify overhead first rotation %", pct, "% (once a run)", record=False))


def bench_group(args, device: torch.device, rows: list[Row]) -> None:
    from hybrid_core.weight_sync import TensorMeta, WeightSender, create_sync_group

    on_gpu = device.type == "cuda"
    backend = "nccl" if on_gpu else "gloo"
    sender_dev = torch.device("cuda", 0) if on_gpu else device
    engine_dev = "cuda:1" if on_gpu else "cpu"
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    model = build_llama(args.small, sender_dev, _dtype(sender_dev), size=args.size)
    metas = [TensorMeta.of(n, p) for n, p in model.named_parameters()]
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    port = free_port()
    engine = ctx.Process(
        target=group_engine,
        args=((args.small, args.size), engine_dev, port, backend, bucket_bytes, args.timeout, requests, replies),
        daemon=True,
    )
    engine.start()
    try:
        group = create_sync_group("127.0.0.1", port, 0, 2, backend=backend, timeout_s=args.timeout, device=sender_dev)
        sender = WeightSender(group, bucket_bytes)
        rates, times = [], {mode: [] for mode in MODES}
        for r in range(args.rounds):
            mode, sender.verify = policy(r)
            requests.put(metas)
            start = time.perf_counter()
            stats = sender.send(model.named_parameters())
            _reply(replies, "received", args.timeout)  # the sync ends when the engine has checked it
            seconds = time.perf_counter() - start
            if r:
                times[mode].append(seconds)
            if mode != "off":
                rates.append(stats.gbps)
            print(
                f"{backend} sync {r} ({describe(sender.verify)}): {stats.bytes / 1e9:.3f} GB in "
                f"{seconds * 1e3:.1f} ms ({stats.bytes / seconds / 1e9:.1f} GB/s)",
                flush=True,
            )
        requests.put("fingerprint")
        exact = _reply(replies, "fingerprint", args.timeout) == fingerprint(model)
        requests.put("path")
        paths = f"checksums: sender {_path(sender_dev)}, engine {_reply(replies, 'path', args.timeout)}"
        print(f"{backend} {paths}", flush=True)
        sender.verify = "full"
        requests.put(("corrupt", 2))
        _reply(replies, "ok", args.timeout)
        requests.put(metas)
        sender.send(model.named_parameters())
        got, caught = replies.get(timeout=args.timeout)
        caught = caught if got == "mismatch" else None
        requests.put(None)
        group.close()
    finally:
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
    if not exact:
        raise AssertionError(f"the engine's weights differ from the sender's after the {backend} syncs")
    print(f"{backend}: engine weights bit-exact", flush=True)
    _check_caught(backend, caught)
    what = "NCCL, GPU 0 -> GPU 1" if on_gpu else "gloo over loopback, CPU"
    unit = f"GB/s ({what}, {args.bucket_mb:g} MB, median, verified)"
    rows += [
        Row("weight sync NCCL GB/s", statistics.median(rates[1:] or rates), unit),
        Row("weight sync NCCL GB/s (first sync)", rates[0], "GB/s", record=False),
        *overhead_rows(times, what, args, paths),
    ]


MODES = ("sampled", "off", "full")


def policy(round_: int):
    """Round 0: a run's first sync (sampled mode checks every piece); then sampled, unverified, full in turn (close
    in time), the sampled ones numbered as a run's syncs 1, 2, ... (each checks another group of pieces)."""
    from hybrid_core.weight_sync import VerifyPolicy

    if round_ == 0:
        return "warm-up", VerifyPolicy("sampled", 0)
    mode = MODES[(round_ - 1) % len(MODES)]
    return mode, VerifyPolicy(mode, (round_ - 1) // len(MODES) + 1)


def describe(p) -> str:
    return {"off": "unverified", "full": "full check"}.get(p.mode) or (
        "first sync: every piece" if p.sync == 0 else f"sampled, sync {p.sync}"
    )


def _path(device) -> str:
    from hybrid_core.weight_sync import checksum_path

    return checksum_path(device)


def overhead_rows(times: dict[str, list[float]], what: str, args, paths: str) -> list[Row]:
    from hybrid_core.weight_sync.sampling import PERIOD

    # The mean over whole rotations: a sampled sync checks one contiguous group, and some groups are empty (after a
    # piece larger than a group) while others hold an embedding; what a run pays is the average.
    n = len(times["sampled"]) // PERIOD * PERIOD or len(times["sampled"])
    off = statistics.mean(times["off"][:n])
    rows = []
    size = " 7B" if args.size == "7b" else ""  # the 1B rows keep the metric names
    size += " MPS" if args.mps else ""
    for mode, name, how in (
        ("sampled", f"weight sync verify overhead{size} %", f"sampled: 1/{PERIOD} of the bytes a sync"),
        ("full", f"weight sync verify overhead full{size} %", "full: every piece"),
    ):
        on = statistics.mean(times[mode][:n])
        pct = (on - off) / off * 100
        # each checked sync against the unverified one right after it (a pair is close in time: the machine's drift,
        # which moves a mean by several %, cancels); printed for the split, not recorded
        paired = statistics.median(a - b for a, b in zip(times[mode][:n], times["off"][:n]))
        print(f"verify {mode}: paired median {paired * 1e3:+.3f} ms a sync ({paired / off * 100:+.2f} %)", flush=True)
        print(
            f"verify {mode}: mean {on * 1e3:.3f} ms vs {off * 1e3:.3f} ms unverified ({pct:+.2f} %); medians "
            f"{statistics.median(times[mode][:n]) * 1e3:.3f} vs {statistics.median(times['off'][:n]) * 1e3:.3f} ms",
            flush=True,
        )
        rows.append(
            Row(
                name,
                pct,
                f"% of the sync's time ({what}, {args.bucket_mb:g} MB, {how}; mean of {n} syncs "
                f"{on * 1e3:.2f} ms vs {n} unverified {off * 1e3:.2f} ms, interleaved; "
                f"{paths}; a byte flipped in flight was caught naming the parameter)",
            )
        )
    return rows


def _check_caught(mode: str, caught: str | None) -> None:
    if not caught or "weight sync verify" not in caught or "checked in the engine's parameter" not in caught:
        raise AssertionError(
            f"{mode}: a byte flipped in flight was not reported as a mismatch naming the parameter (got {caught!r})"
        )
    print(f"{mode}: corrupted sync caught: {caught[:200]}", flush=True)


def main() -> int:
    args = parse_args()
    if args.rounds is None:
        from hybrid_core.weight_sync.sampling import PERIOD

        args.rounds = 1 + len(MODES) * (3 * PERIOD if not args.small else 2)  # GPU: 1 rotation warm, 2 measured
    if args.bucket_mb is None:
        args.bucket_mb = 1 / 32 if args.small else 512  # small: many buckets, some tensors larger than one
    if args.mps and args.small:
        print("--mps needs a GPU", file=sys.stderr)
        return 2
    daemon = None
    if args.mps:  # before this process or the engine's creates a CUDA context: both become MPS clients
        import os
        import tempfile

        from hybrid_core.mps_daemon import MpsDaemon

        daemon = MpsDaemon(tempfile.mkdtemp(prefix="ws-mps-log-"))
        os.environ.update(daemon.start())
        print(f"CUDA MPS: a control daemon of this bench's own ({daemon.pipe_dir})", flush=True)
    try:
        return _run(args)
    finally:
        if daemon is not None:
            daemon.stop()


def _run(args: argparse.Namespace) -> int:
    if args.small:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("no GPU: use --small for the CPU logic check", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    modes = {
        "auto": ["ipc"] + (["nccl"] if args.small or torch.cuda.device_count() >= 2 else []),
        "both": ["ipc", "nccl"],
        "ipc": ["ipc"],
        "nccl": ["nccl"],
    }[args.mode]
    if "nccl" in modes and not args.small and torch.cuda.device_count() < 2:
        print("nccl mode needs two visible GPUs", file=sys.stderr)
        return 2
    label = device_label(device)
    print(f"device: {label}; torch {torch.__version__}; modes {modes}", flush=True)
    failed = []
    suffix = " (--small: logic check only)" if args.small else ""
    for mode in modes:
        rows: list[Row] = []
        try:
            (bench_ipc if mode == "ipc" else bench_group)(args, device, rows)
        except Exception:
            traceback.print_exc()
            failed.append(mode)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rows:  # printed and recorded mode by mode, so a later mode that crashes or hangs loses nothing
            print_table(f"weight sync ({mode}) on {label}{suffix}", rows)
            if args.record:
                print(f"appended {append_results(rows, label)} rows to bench/RESULTS.md", flush=True)
    if failed:
        print(f"FAILED modes: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
