"""``Placement``: where a shard lives, in every form ``torch.distributed._remote_device`` accepts."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from shardwise.errors import PlacementError, PlacementTypeError

__all__ = ["Placement", "PlacementError", "PlacementTypeError", "unusable_reason"]

_PARSE_HINT = "The valid format is '<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'"


def _parse_device(device: Any, spec: Any) -> torch.device:
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise PlacementError(f"invalid placement {spec!r}: {str(device)!r} is not a torch device: {exc}") from None


def unusable_reason(device: torch.device) -> Optional[str]:
    """Why this process cannot hold tensors on ``device``, or None when it can.

    The one answer to "can this rank use device X" (every entry point that
    makes local shards on a placement's device asks it before data moves):

    * ``cpu`` and ``meta``: always;
    * a type with a torch device module (``cuda``, ``xpu``, ``mps``,
      ``mtia``, and backends that register one): when the module says it is
      available and, for a device with an index, the index is below its
      device count (``cuda`` alone means the current CUDA device);
    * any other type (``hpu`` without its plugin, ``xla``, ``vulkan``, ...):
      when torch can make an empty tensor on it here.

    Args:
        device: The device.

    Returns:
        None, or a sentence saying why (torch's own wording in parentheses
        where torch has one).
    """
    kind = device.type
    if kind in ("cpu", "meta"):
        return None
    try:
        module: Any = torch.get_device_module(kind)
    except RuntimeError:
        module = None  # no torch.<type> module registered: ask torch to allocate instead
    if module is None or not callable(getattr(module, "is_available", None)):
        return _probe(device)
    if not module.is_available():
        if kind == "cuda" and not torch.backends.cuda.is_built():
            return f"this torch ({torch.__version__}) was built without CUDA (Torch not compiled with CUDA enabled)"
        return f"torch.{kind}.is_available() is False in this process (no {kind} device, driver or runtime is visible)"
    count = module.device_count() if callable(getattr(module, "device_count", None)) else None
    if device.index is not None and count is not None and device.index >= count:
        seen = f"{kind}:0..{kind}:{count - 1}" if count else "none"
        visible = " and CUDA_VISIBLE_DEVICES" if kind == "cuda" else ""
        return f"this process sees {count} {kind} device(s) ({seen}); check the index{visible} (invalid device ordinal)"
    return None


def _probe(device: torch.device) -> Optional[str]:
    """None when torch can make an (empty) tensor on ``device`` in this process, else why not."""
    try:
        torch.empty(0, device=device)
    except Exception as exc:  # noqa: BLE001 - any failure means the device is unusable; its text is the reason
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"torch cannot make a tensor on {device} in this process ({type(exc).__name__}: {first})"
    return None


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except RuntimeError:
        return False
    return True


class Placement:
    """Where a shard lives, in the forms ``torch.distributed._remote_device`` accepts.

    * ``rank:R/DEVICE`` (``rank:0/cpu``, ``rank:3/cuda:1``): global rank
      ``R`` (a rank of the default, world group, as in torch; it must be a
      member of the tensor's process group), on ``DEVICE``;
    * ``rank:R``: global rank ``R``, on the CPU;
    * ``DEVICE`` (``"cpu"``, ``"cuda:0"``) or a ``torch.device``: a device
      without a rank. ``rank()`` is None; as in torch, a shard placed so
      is held by no rank (a tensor built from such a spec has no local
      shards), and operations that must move its data refuse it;
    * ``WORKER/DEVICE`` or ``WORKER``: a torch RPC worker name (``rank()``
      None, ``worker_name()`` the name); parsed as torch does, but sharded
      tensors cannot use it, as shardwise does not support RPC.

    The methods mirror ``_remote_device``: ``rank()``, ``device()``,
    ``worker_name()``; a placement compares equal to its string form and
    to a ``_remote_device`` with the same fields.

    Args:
        spec: A string of one of those forms, a ``torch.device``, another
            :class:`Placement`, or a ``torch.distributed._remote_device``.

    Raises:
        ValueError: the string is not of one of those forms (or has a
            negative rank); the message carries torch's "Could not parse
            remote_device" wording.
        PlacementError: the device is not a torch device (a ``ValueError``
            and, as in torch, a ``RuntimeError``).
        PlacementTypeError: ``spec`` is of another type (a ``TypeError``,
            as in torch, and a ``ValueError``).
    """

    __slots__ = ("_rank", "_device", "_worker")
    _rank: Optional[int]
    _device: torch.device
    _worker: Optional[str]

    def __init__(self, spec: Union[str, Placement, torch.device, Any]) -> None:
        if isinstance(spec, Placement):
            self._rank, self._device, self._worker = spec._rank, spec._device, spec._worker
            return
        if isinstance(spec, torch.device):
            self._rank, self._device, self._worker = None, spec, None
            return
        if not isinstance(spec, str):
            rank, device, worker = (getattr(spec, name, None) for name in ("rank", "device", "worker_name"))
            if not (callable(rank) and callable(device)):
                raise PlacementTypeError(
                    f"a placement must be a 'rank:R/DEVICE' string (e.g. 'rank:0/cpu'), a device string, a "
                    f"torch.device or a placement object, got {type(spec).__name__} {spec!r:.80}: "
                    f"Invalid type for remote_device: {type(spec)}"
                )
            self._rank = None if rank() is None else int(rank())
            self._device = _parse_device(device(), spec)
            self._worker = worker() if callable(worker) else None
            return
        self._rank, self._device, self._worker = self._parse(spec)

    @staticmethod
    def _parse(spec: str) -> tuple[Optional[int], torch.device, Optional[str]]:
        def invalid(why: str) -> ValueError:
            return ValueError(
                f"invalid placement {spec!r}: {why} (e.g. 'rank:0/cpu', 'rank:1/cuda:0', 'rank:0', 'cpu'). "
                f"Could not parse remote_device: {spec}. {_PARSE_HINT}"
            )

        fields = spec.strip().split("/")
        if len(fields) > 2:
            raise invalid("expected at most one '/'")
        if len(fields) == 2:
            worker, device_text = fields
        elif _is_device(fields[0]):
            return None, torch.device(fields[0]), None
        else:
            worker, device_text = fields[0], "cpu"
        if not worker:
            raise invalid("nothing before the '/'")
        device = _parse_device(device_text, spec)
        parts = worker.split(":")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "rank"):
            raise invalid("expected 'rank:R' before the '/'")
        if len(parts) == 1:
            return None, device, worker
        text = parts[1]
        if text.startswith("-") and text[1:].isascii() and text[1:].isdigit():
            raise invalid("rank must be >= 0")
        if not (text.isascii() and text.isdigit()):
            raise invalid(f"rank {parts[1]!r} is not an integer")
        return int(text), device, None

    def rank(self) -> Optional[int]:
        """The global rank that holds the shard (None for a placement without one)."""
        return self._rank

    def device(self) -> torch.device:
        """The device the shard lives on."""
        return self._device

    def worker_name(self) -> Optional[str]:
        """The torch RPC worker name, for a ``WORKER/DEVICE`` placement (else None)."""
        return self._worker

    def check_usable(self) -> None:
        """Raise unless this process can hold tensors on this placement's device (see :func:`unusable_reason`).

        Called on the rank the placement names, before any data moves to it.

        Raises:
            PlacementError: the device is unusable here (a ``ValueError``;
                the message names the placement and the reason).
        """
        reason = unusable_reason(self._device)
        if reason is None:
            return
        holder = f"rank {self._rank}" if self._rank is not None else "this rank"
        alternative = f"'rank:{self._rank}/cpu'" if self._rank is not None else "'cpu'"
        raise PlacementError(
            f"placement '{self}' names device {self._device}, which {holder} cannot use: {reason}. Place the "
            f"shard on a device {holder} has (e.g. {alternative}), or run on a host where {self._device} is available"
        )

    def with_device(self, device: Union[str, torch.device]) -> Placement:
        """The same rank (or worker) on ``device``."""
        out = Placement(self)
        out._device = _parse_device(device, device)
        return out

    def __str__(self) -> str:
        if self._rank is not None:
            return f"rank:{self._rank}/{self._device}"
        if self._worker is not None:
            return f"{self._worker}/{self._device}"
        return str(self._device)

    def __repr__(self) -> str:
        return f"Placement('{self}')"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (str, torch.device)) or (
            not isinstance(other, Placement) and callable(getattr(other, "rank", None))
        ):
            try:
                other = Placement(other)
            except (ValueError, TypeError, RuntimeError):
                return False
        if not isinstance(other, Placement):
            return NotImplemented
        return (self._rank, self._device, self._worker) == (other._rank, other._device, other._worker)

    def __hash__(self) -> int:
        return hash((self._rank, str(self._device), self._worker))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Placement, (str(self),))
