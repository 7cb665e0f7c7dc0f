"""Device check of connector.transfer: byte-exact round trips and copy throughput.

    python scripts/gpu_check.py            # on a CUDA machine: full sizes (32 layers, 8 heads, 128, block 16, bf16)
    python scripts/gpu_check.py --quick    # small sizes; runs on CPU when there is no CUDA

Exits 1 on any byte mismatch. Throughput compares the batched stream path (one index_select + permute per layer
into device staging, one copy into a pinned buffer) with a per-block, per-layer ``.cpu()`` loop.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.transfer import BlockTransfer, KVLayout


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model(
    *, args: argparse.Namespace, layout: KVLayout, dtype: torch.dtype, device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (2, args.num_blocks, args.block_size, args.heads, args.head_size)
    if layout is KVLayout.HND:
        shape = (2, args.num_blocks, args.heads, args.block_size, args.head_size)
    out = {}
    for layer in range(args.layers):  # random bit patterns: every byte matters, NaNs included
        bits = torch.randint(-(2**15), 2**15, shape, generator=gen, device=device, dtype=torch.int32)
        out[f"layers.{layer}"] = bits.to(torch.int16).view(dtype)
    return out


def transfer(caches: dict[str, torch.Tensor], layout: KVLayout, args: argparse.Namespace) -> BlockTransfer:
    """One store and one load buffer of ``args.batch`` blocks (pinned on CUDA): the checks run one batch at a time."""
    return BlockTransfer(
        kv_caches=caches, layout=layout, max_blocks_per_batch=args.batch, store_buffers=1, load_buffers=1
    )


def gather_bytes(xfer: BlockTransfer, ids: list[int]) -> list[bytes]:
    out: list[bytes] = []
    for chunk in xfer.split(ids):
        batch = xfer.gather(chunk)
        if batch is None:
            raise RuntimeError("store pool exhausted in a sequential check")
        with batch:
            batch.synchronize()
            out.extend(batch.block_view(i).tobytes() for i in range(len(chunk)))
    return out


def round_trip(args: argparse.Namespace, device: torch.device, layout: KVLayout, dtype: torch.dtype) -> list[str]:
    caches = model(args=args, layout=layout, dtype=dtype, device=device, seed=1)
    xfer = transfer(caches, layout, args)
    ids = list(range(1, args.num_blocks, 2))[: 2 * args.batch + 3]  # several batches, the last one partial
    blobs = gather_bytes(xfer, ids)
    errors = []
    # Canonical order on the device equals the CPU path's (which the unit tests check against explicit loops).
    cpu_caches = {n: t.cpu() for n, t in caches.items()}
    if blobs[:3] != gather_bytes(transfer(cpu_caches, layout, args), ids[:3]):
        errors.append("device bytes differ from the CPU path's canonical bytes")
    fresh = {n: torch.zeros_like(t) for n, t in caches.items()}
    loader = transfer(fresh, layout, args)
    for start in range(0, len(ids), args.batch):
        handle = loader.scatter(ids[start : start + args.batch], blobs[start : start + args.batch])
        handle.wait_on_current_stream()
        handle.release()
    sync(device)
    untouched = [b for b in range(args.num_blocks) if b not in set(ids)]
    for name in caches:
        if not torch.equal(fresh[name][:, ids].view(torch.uint8), caches[name][:, ids].view(torch.uint8)):
            errors.append(f"{name}: loaded blocks differ")
        if fresh[name][:, untouched].view(torch.uint8).any():
            errors.append(f"{name}: untouched blocks were written")
    return errors


def timed(fn: Callable[[], None], *, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeats


def throughput(args: argparse.Namespace, device: torch.device) -> list[tuple[str, float, float]]:
    layout = KVLayout.NHD
    caches = model(args=args, layout=layout, dtype=torch.bfloat16, device=device, seed=2)
    xfer = transfer(caches, layout, args)
    ids = list(range(0, args.num_blocks, max(1, args.num_blocks // args.batch)))[: args.batch]
    nbytes = len(ids) * xfer.geometry.block_bytes
    layers = list(caches.values())

    def batched_gather() -> None:
        batch = xfer.gather(ids)
        if batch is None:
            raise RuntimeError("store pool exhausted")
        batch.synchronize()
        batch.release()

    def loop_gather() -> None:
        for b in ids:
            for t in layers:
                t[:, b].cpu()

    blobs = gather_bytes(xfer, ids)
    host_blocks = [[t[:, b].cpu() for t in layers] for b in ids]

    def batched_scatter() -> None:
        xfer.scatter(ids, blobs).release()

    def loop_scatter() -> None:
        for b, per_layer in zip(ids, host_blocks, strict=True):
            for t, h in zip(layers, per_layer, strict=True):
                t[:, b].copy_(h)
        sync(device)

    rows = []
    for name, fast, slow in [
        ("gather D2H", batched_gather, loop_gather),
        ("scatter H2D*", batched_scatter, loop_scatter),
    ]:
        t_fast = timed(fast, repeats=args.repeats, device=device)
        t_slow = timed(slow, repeats=max(1, args.repeats // 4), device=device)
        rows.append((name, nbytes / t_fast / 1e9, nbytes / t_slow / 1e9))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (also runs on CPU)")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = (2, 4, 64, 16, 48, 8) if args.quick else (32, 8, 128, 16, 1024, 256)
    args.layers, args.heads, args.head_size, args.block_size, args.num_blocks, args.batch = sizes
    args.repeats = args.repeats or (4 if args.quick else 20)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device={name} torch={torch.__version__} layers={args.layers} heads={args.heads} "
        f"head_size={args.head_size} block={args.block_size} batch={args.batch}"
    )

    failures = 0
    for layout in KVLayout:
        for dtype in (torch.bfloat16, torch.float16):
            errors = round_trip(args, device, layout, dtype)
            failures += len(errors)
            status = "ok" if not errors else "MISMATCH " + "; ".join(errors[:3])
            print(f"round trip {layout.value} {str(dtype).removeprefix('torch.')}: {status}")

    block_mib = 2 * args.layers * args.block_size * args.heads * args.head_size * 2 / 2**20
    print(f"\nthroughput, {args.batch} blocks of {block_mib:.2f} MiB per batch (bf16, NHD)")
    print(f"{'path':<13} {'batched GB/s':>13} {'per-block GB/s':>15} {'ratio':>7}")
    for path, fast, slow in throughput(args, device):
        print(f"{path:<13} {fast:>13.2f} {slow:>15.2f} {fast / slow:>6.1f}x")
    print("* scatter includes the host memcpy of the blocks' bytes into the pinned buffer")
    if failures:
        print(f"FAILED: {failures} mismatches")
        return 1
    print("all round trips byte-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
