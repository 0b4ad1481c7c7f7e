"""NCCL smoke program for a GPU machine (run by ``run_gpu_tests.sh``)::

    torchrun --standalone --nproc-per-node 1 plugins/shardwise-nccl/scripts/nccl_smoke.py

Initialises shardwise with backend ``nccl``, runs ``all_reduce``,
``all_gather`` (uneven) and ``all_to_all_single`` (uneven) on CUDA tensors,
one CPU tensor staged through the GPU, and an autograd ``all_reduce`` through
``shardwise.nn.functional``; checks every result and prints it. Works for
any number of ranks up to the number of GPUs.
"""

from __future__ import annotations

import sys

import torch

import shardwise
import shardwise.nn.functional as swf


def say(line: str) -> None:
    """Print one line in one write, so lines of concurrent ranks do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def check(what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.device != expected.device or got.dtype != expected.dtype or not torch.equal(got, expected):
        raise AssertionError(f"{what}: expected {expected!r}, got {got!r}")


def main() -> int:
    group = shardwise.init("nccl")
    try:
        rank, size, device = group.rank, group.size, group.device
        say(f"rank {rank}/{size}: backend={group.backend} device={device} ({torch.cuda.get_device_name(device)})")
        if group.backend != "nccl":
            raise AssertionError(f"backend is {group.backend!r}, not 'nccl'")
        if device.type != "cuda":
            raise AssertionError(f"group device is {device}, not a CUDA device")
        total = float(size * (size + 1) // 2)

        t = torch.full((4,), float(rank + 1), device=device)
        group.all_reduce(t)
        check("all_reduce", t, torch.full((4,), total, device=device))
        say(f"rank {rank}: all_reduce -> {t.tolist()}")

        h = torch.full((3,), float(rank + 1), dtype=torch.bfloat16)  # CPU tensor, staged via the GPU
        group.all_reduce(h)
        check("all_reduce of a CPU bfloat16 tensor", h, torch.full((3,), total, dtype=torch.bfloat16))
        say(f"rank {rank}: all_reduce (cpu bfloat16) -> {h.tolist()}")

        mine = torch.full((rank + 1, 2), float(rank), device=device)
        pieces = group.all_gather(mine)
        for r, piece in enumerate(pieces):
            check(f"all_gather from rank {r}", piece, torch.full((r + 1, 2), float(r), device=device))
        say(f"rank {rank}: all_gather -> {[p.tolist() for p in pieces]}")

        ins = [rank + d + 1 for d in range(size)]  # rows sent to rank d
        outs = [s + rank + 1 for s in range(size)]  # rows received from rank s
        x = torch.cat([torch.full((ins[d], 2), float(10 * rank + d), device=device) for d in range(size)])
        y = group.all_to_all_single(x, output_split_sizes=outs, input_split_sizes=ins)
        expected = torch.cat([torch.full((outs[s], 2), float(10 * s + rank), device=device) for s in range(size)])
        check("all_to_all_single", y, expected)
        say(f"rank {rank}: all_to_all_single -> {y.tolist()}")

        w = torch.full((2,), float(rank + 1), device=device, requires_grad=True)
        z = swf.all_reduce(w)
        z.sum().backward()
        assert w.grad is not None
        check("nn.functional.all_reduce", z.detach(), torch.full((2,), total, device=device))
        check("nn.functional.all_reduce grad", w.grad, torch.full((2,), float(size), device=device))
        say(f"rank {rank}: nn.functional.all_reduce -> {z.tolist()}, grad {w.grad.tolist()}")

        torch.cuda.synchronize(device)
        group.barrier()
    finally:
        shardwise.destroy()
    say(f"rank {rank} OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
