"""Speed of the weight-sync checksum (``hybrid_core.weight_sync.verify``) on one device, path by path.

For each path the device can run ("triton": one fused kernel; "int_mm": torch._int_mm against a 16-column matrix;
"reduce": reductions), the checksum of a flat buffer of ``--mb`` MB read as bf16 words: median time over
``--repeat`` calls and the bandwidth it reaches; every path must give the same value (exit 1 otherwise). Then the
per-piece cost over a model's parameters (~1B Llama, bf16: one checksum per tensor, as a full check does).

    python bench/checksum_speed.py            # GPU
    python bench/checksum_speed.py --small    # CPU, a tiny buffer: logic check only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from _common import build_llama, device_label


def table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    for line in (header, ["-" * w for w in widths], *rows):
        print("  ".join(f"{x:<{w}}" for x, w in zip(line, widths)), flush=True)


def timed(fn, device: torch.device, repeat: int) -> tuple[float, int]:
    value = int(fn())  # warm-up (compiles the kernel, builds the tables)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        if int(out) != value:
            raise AssertionError("a checksum changed between calls on the same bytes")
    return statistics.median(times), value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=512)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    from hybrid_core.weight_sync import verify

    device = torch.device("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    mb = 1 if args.small else args.mb
    nbytes = int(mb * (1 << 20)) // 2 * 2
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    best = verify.checksum_path(device)
    print(f"device {device_label(device)}: checksum path {best}", flush=True)
    paths = ["triton", "int_mm", "reduce"] if device.type == "cuda" else [best, "reduce"]
    rows, values = [], {}
    for path in dict.fromkeys(paths):
        if path == "triton" and best != "triton":
            continue
        verify._PATH[device] = path
        try:
            seconds, values[path] = timed(lambda: verify.checksum(data, 2), device, args.repeat)
        except Exception as e:
            print(f"{path}: {type(e).__name__}: {e}", flush=True)
            continue
        rows.append([path, f"{nbytes / 1e6:.0f} MB", f"{seconds * 1e3:.3f} ms", f"{nbytes / seconds / 1e9:.1f} GB/s"])
    verify._PATH[device] = best
    table(["path", "bytes", "median", "rate"], rows)
    if len(set(values.values())) > 1:
        print(f"paths disagree: {values}", flush=True)
        return 1
    model = build_llama(args.small, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    pieces = [p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()]
    total = sum(p.numel() for p in pieces)

    def every_piece() -> torch.Tensor:
        return torch.stack([verify.checksum(p, 2 if device.type == "cuda" else 4) for p in pieces]).sum()

    seconds, _ = timed(every_piece, device, max(3, args.repeat // 4))
    table(
        ["model pieces", "bytes", "median (all pieces)", "per piece", "rate"],
        [
            [
                str(len(pieces)),
                f"{total / 1e9:.2f} GB",
                f"{seconds * 1e3:.2f} ms",
                f"{seconds / len(pieces) * 1e6:.1f} us",
                f"{total / seconds / 1e9:.1f} GB/s",
            ]
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
