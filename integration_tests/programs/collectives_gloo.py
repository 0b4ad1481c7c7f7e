"""A user's program: collectives over the automatically chosen backend.

Run it the way users do::

    torchrun --standalone --nproc-per-node 2 integration_tests/programs/collectives_gloo.py

``shardwise.init()`` is called without a backend name, so on a machine
without CUDA (or with ``CUDA_VISIBLE_DEVICES=""``) it must pick ``gloo``.
Every rank checks every result against the value it must have and prints
``rank R OK``; any mismatch raises, so torchrun exits non-zero.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import shardwise
import shardwise.nn.functional as swf


def say(line: str) -> None:
    """Print one line in one write, so lines of concurrent ranks do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def check_equal(what: str, got: Any, expected: Any) -> None:
    """Raise with both values when ``got`` is not exactly ``expected``."""
    if isinstance(expected, torch.Tensor):
        ok = (
            isinstance(got, torch.Tensor)
            and got.dtype == expected.dtype
            and got.shape == expected.shape
            and torch.equal(got.detach(), expected)
        )
    else:
        ok = got == expected
    if not ok:
        raise AssertionError(f"rank {os.environ.get('RANK')}: {what}: expected\n{expected!r}\ngot\n{got!r}")


def split(src: int, dst: int, variant: int) -> int:
    """Rows rank ``src`` sends to rank ``dst`` in the uneven all-to-alls."""
    if variant == 0:
        return src + dst + 1  # all different, none empty
    return (src + 2 * dst) % 3  # some empty


def rows_for(src: int, dst: int, variant: int, width: int = 3) -> torch.Tensor:
    """The block ``src`` sends to ``dst``: every element says who sent it to whom."""
    n = split(src, dst, variant)
    return torch.arange(n * width, dtype=torch.float32).reshape(n, width) + 1000 * src + 100 * dst


# -- shardwise.Group collectives ------------------------------------------------
def check_group_collectives(group: shardwise.Group) -> None:
    rank, size = group.rank, group.size

    group.barrier()

    # all_reduce: in place, several ops and dtypes.
    t = torch.full((4,), float(rank + 1))
    out = group.all_reduce(t)
    check_equal("all_reduce returns its argument", out is t, True)
    check_equal("all_reduce sum", t, torch.full((4,), float(size * (size + 1) // 2)))
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3) * (rank + 1)
    group.all_reduce(t, op="max")
    check_equal("all_reduce max int64", t, torch.arange(6, dtype=torch.int64).reshape(2, 3) * size)
    t = torch.full((3,), float(rank))
    group.all_reduce(t, op="avg")
    check_equal("all_reduce avg", t, torch.full((3,), (size - 1) / 2))
    t = torch.full((2,), float(rank + 1), dtype=torch.float64)
    group.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    prod = 1.0
    for r in range(size):
        prod *= r + 1
    check_equal("all_reduce product (torch ReduceOp)", t, torch.full((2,), prod, dtype=torch.float64))

    # broadcast: in place, from the last rank.
    t = torch.full((2, 2), float(rank), dtype=torch.float64)
    group.broadcast(t, src=size - 1)
    check_equal("broadcast", t, torch.full((2, 2), float(size - 1), dtype=torch.float64))

    # all_gather with uneven sizes along dim 0 (rank 0 sends no rows at all
    # in the second round).
    for extra in (1, 0):
        mine = torch.arange((rank + extra) * 2, dtype=torch.float32).reshape(rank + extra, 2) + 100 * rank
        gathered = group.all_gather(mine)
        check_equal(f"uneven all_gather (+{extra}) count", len(gathered), size)
        for r in range(size):
            expected = torch.arange((r + extra) * 2, dtype=torch.float32).reshape(r + extra, 2) + 100 * r
            check_equal(f"uneven all_gather (+{extra}) from rank {r}", gathered[r], expected)

    # all_to_all_single with uneven splits, with and without output sizes.
    for variant in (0, 1):
        inp = torch.cat([rows_for(rank, d, variant) for d in range(size)])
        ins = [split(rank, d, variant) for d in range(size)]
        outs = [split(s, rank, variant) for s in range(size)]
        expected = torch.cat([rows_for(s, rank, variant) for s in range(size)])
        got = group.all_to_all_single(inp, output_split_sizes=outs, input_split_sizes=ins)
        check_equal(f"all_to_all_single variant {variant}", got, expected)
        got = group.all_to_all_single(inp, input_split_sizes=ins)
        check_equal(f"all_to_all_single variant {variant}, output sizes derived", got, expected)

    # all_to_all with a list of per-destination tensors.
    received = group.all_to_all([rows_for(rank, d, 0, width=2) for d in range(size)])
    for s in range(size):
        check_equal(f"all_to_all from rank {s}", received[s], rows_for(s, rank, 0, width=2))

    # exchange: JSON-safe metadata from every rank (tuples come back as lists).
    info = group.exchange({"rank": rank, "name": f"worker-{rank}", "shape": (rank, 2), "pid": os.getpid()})
    check_equal("exchange count", len(info), size)
    for r, item in enumerate(info):
        check_equal(f"exchange rank {r}", (item["rank"], item["name"], item["shape"]), (r, f"worker-{r}", [r, 2]))
    check_equal("exchange carries distinct processes", len({item["pid"] for item in info}), size)


# -- shardwise.nn.functional: values and gradients ------------------------------
def check_autograd(group: shardwise.Group) -> None:
    rank, size = group.rank, group.size
    total = size * (size + 1) // 2

    # all_reduce (sum): every rank's loss weights the sum by (rank + 1), so
    # d(sum of losses)/dx_r = sum_k (k + 1) on every rank.
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    y = swf.all_reduce(x)
    check_equal("F.all_reduce value", y.detach(), torch.full((3,), float(total)))
    check_equal("F.all_reduce leaves its input alone", x.detach(), torch.full((3,), float(rank + 1)))
    ((rank + 1) * y).sum().backward()
    check_equal("F.all_reduce grad", x.grad, torch.full((3,), float(total)))

    # all_gather: rank k weights the piece from rank i by (i + 1) + 10 k, so
    # the gradient of x_r is sum_k (r + 1 + 10 k).
    x = torch.full((2, 2), float(rank + 1), requires_grad=True)
    pieces = swf.all_gather(x)
    check_equal("F.all_gather count", len(pieces), size)
    for i, piece in enumerate(pieces):
        check_equal(f"F.all_gather value from rank {i}", piece.detach(), torch.full((2, 2), float(i + 1)))
    loss = sum(((i + 1) + 10 * rank) * piece.sum() for i, piece in enumerate(pieces))
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    expected_grad = float(size * (rank + 1) + 10 * (size * (size - 1) // 2))
    check_equal("F.all_gather grad", x.grad, torch.full((2, 2), expected_grad))

    # all_to_all_single with uneven splits: rank d weights the rows it got
    # from rank s by 10 d + s + 1, so the rows rank r sent to d get that
    # gradient back.
    for variant, group_arg in ((0, None), (1, group)):
        ins = [split(rank, d, variant) for d in range(size)]
        outs = [split(s, rank, variant) for s in range(size)]
        x = torch.cat([rows_for(rank, d, variant, width=2) for d in range(size)]).requires_grad_(True)
        output = torch.empty(sum(outs), 2)
        y = swf.all_to_all_single(output, x, output_split_sizes=outs, input_split_sizes=ins, group=group_arg)
        expected = torch.cat([rows_for(s, rank, variant, width=2) for s in range(size)])
        check_equal(f"F.all_to_all_single value (variant {variant})", y.detach(), expected)
        weights = torch.cat([torch.full((outs[s], 2), float(10 * rank + s + 1)) for s in range(size)])
        (weights * y).sum().backward()
        grad_rows = torch.cat([torch.full((ins[d], 2), float(10 * d + rank + 1)) for d in range(size)])
        check_equal(f"F.all_to_all_single grad (variant {variant})", x.grad, grad_rows)

    # reduce_scatter: rank r receives sum_k input_list_k[r]; its loss weights
    # it by (r + 1), so input_list[i] gets gradient (i + 1) on every rank.
    inputs = [torch.full((2,), float((rank + 1) * (i + 1)), requires_grad=True) for i in range(size)]
    out = swf.reduce_scatter(torch.empty(2), inputs)
    check_equal("F.reduce_scatter value", out.detach(), torch.full((2,), float(total * (rank + 1))))
    ((rank + 1) * out).sum().backward()
    for i, t in enumerate(inputs):
        check_equal(f"F.reduce_scatter grad of input {i}", t.grad, torch.full((2,), float(i + 1)))

    # The functions also take torch's own process group (wrapped on the fly).
    world = dist.group.WORLD
    if world is not None:
        x = torch.full((2,), float(rank + 1), requires_grad=True)
        y = swf.all_reduce(x, group=world)
        y.sum().backward()
        check_equal("F.all_reduce over torch's WORLD group", y.detach(), torch.full((2,), float(total)))
        check_equal("F.all_reduce grad over torch's WORLD group", x.grad, torch.full((2,), float(size)))


def main() -> int:
    group = shardwise.init()
    try:
        check_equal("automatically chosen backend", group.backend, "gloo")
        check_equal("default group is init's group", shardwise.get_default_group() is group, True)
        check_equal("rank", group.rank, int(os.environ["RANK"]))
        check_equal("size", group.size, int(os.environ["WORLD_SIZE"]))
        check_equal("device", group.device, torch.device("cpu"))
        check_group_collectives(group)
        check_autograd(group)
        group.barrier()
        rank = group.rank
    finally:
        shardwise.destroy()
    check_equal("initialised after destroy", shardwise.is_initialized(), False)
    say(f"rank {rank} OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
