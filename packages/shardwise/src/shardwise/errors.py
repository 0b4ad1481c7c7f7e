"""Exceptions raised by shardwise.

Every exception derives from :class:`ShardwiseError` and from the builtin
exception a caller would naturally catch (``LookupError`` for a missing
backend, ``RuntimeError`` for a failed collective), so existing ``except``
clauses keep working.
"""

from __future__ import annotations

import pickle

__all__ = [
    "BackendNotFoundError",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "GroupMismatchError",
    "InvalidArgumentError",
    "LaunchError",
    "LocalShardsMismatchError",
    "OpNotFoundError",
    "PeerError",
    "PeerLostError",
    "PlacementError",
    "PlacementTypeError",
    "PluginError",
    "ShardwiseError",
    "UnsafeCheckpointError",
    "UnsupportedOperandError",
]


class ShardwiseError(Exception):
    """Base class of every shardwise error."""


class PluginError(ShardwiseError, RuntimeError):
    """A plugin is broken: bad records, duplicate registrations, bad hooks."""


class BackendNotFoundError(ShardwiseError, LookupError):
    """No installed plugin provides the backend that was asked for."""


class BackendUnavailableError(ShardwiseError, RuntimeError):
    """The backend is installed but cannot run here (no CUDA, no MPI)."""


class OpNotFoundError(ShardwiseError, LookupError, NotImplementedError):
    """No plugin implements an op for the given sharding spec.

    Also a ``NotImplementedError`` (hence a ``RuntimeError``), which is what
    torch 2.13's ShardedTensor raised for an unsupported op.
    """


class UnsupportedOperandError(OpNotFoundError, TypeError):
    """A sharded op got an operand it cannot take, such as a plain tensor next to a ShardedTensor.

    An :class:`OpNotFoundError` (so a ``RuntimeError``, what torch 2.13
    raised: no sharded implementation takes these operands) and a
    ``TypeError`` (what shardwise raised before), so ``except`` clauses
    written for either keep working.
    """


class InvalidArgumentError(ShardwiseError, TypeError, ValueError):
    """An argument of the wrong type, where torch 2.13 raised ``ValueError`` (``ChunkShardingSpec(None, ...)``).

    Both a ``TypeError`` and a ``ValueError``, so code written for either
    keeps working.
    """


class LocalShardsMismatchError(ShardwiseError, ValueError, RuntimeError):
    """The local shards a rank passed do not match the shards the global metadata places on it.

    Both a ``ValueError`` (what shardwise raised) and a ``RuntimeError``
    (what torch 2.13 raises for a wrong number of local shards).
    """


class GroupMismatchError(ShardwiseError, RuntimeError):
    """ShardedTensors of different process groups were used together in one op.

    A ``RuntimeError``, as torch 2.13 raises; the message names both groups.
    """


class LaunchError(ShardwiseError, RuntimeError):
    """The launcher's environment is incomplete or ``init`` was misused."""


class CollectiveMismatchError(ShardwiseError, RuntimeError):
    """Ranks called a collective with arguments that do not agree.

    Raised on every rank of the group, so that no rank is left waiting.
    """


class PeerError(ShardwiseError, RuntimeError):
    """Another rank rejected its own input to a collective this rank joined.

    The rank at fault raises the real error (``TypeError``, ``ValueError``);
    every other rank raises this one, naming that rank.
    """


class PeerLostError(ShardwiseError, RuntimeError):
    """A collective could not complete: a peer died, stopped calling collectives, or did not answer in time.

    Raised by a group's collectives when the backend reports a closed
    connection or its timeout (``shardwise.init(timeout=...)``,
    ``SHARDWISE_TIMEOUT``) expired; the message names this rank, the
    collective and the backend's own report. The group cannot be used
    afterwards: end the job and restart it from a checkpoint. (The mpi
    backend cannot cancel a blocked call; it aborts the job instead, see
    shardwise-mpi's README.)
    """


class UnsafeCheckpointError(ShardwiseError, pickle.UnpicklingError):
    """A checkpoint holds a pickle that names something other than plain data (loading it could run code).

    Raised by ``shardwise._modules.checkpoint.load`` for a ``.metadata`` file that
    refers to anything but DCP's metadata types, or a saved value that
    ``torch.load(weights_only=True)`` refuses. Nothing from it was called.
    """


class PlacementError(ShardwiseError, ValueError, RuntimeError):
    """A placement names a device torch does not know (``rank:0/cuda:x``, ``rank:0/foo``), or one its rank cannot use.

    Both a ``ValueError`` (what shardwise raised for every malformed
    placement) and a ``RuntimeError`` (what torch 2.13 raises for a bad
    device string or a missing CUDA device ordinal), so ``except`` clauses
    written for either keep working.
    """


class PlacementTypeError(ShardwiseError, TypeError, ValueError):
    """A placement is neither a string, a ``torch.device`` nor a placement object.

    A ``TypeError`` as in torch 2.13, and a ``ValueError`` as shardwise raised before.
    """
