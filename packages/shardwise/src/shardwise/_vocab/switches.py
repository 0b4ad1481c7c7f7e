"""On/off environment switches (``SHARDWISE_VERIFY_COLLECTIVES=0`` ...): one reading for all of them."""

from __future__ import annotations

import os

__all__ = ["OFF_VALUES", "switched_on"]

#: Values that turn a switch off, compared without case or surrounding spaces; anything else leaves it on.
OFF_VALUES = ("0", "false", "no", "off")


def switched_on(name: str) -> bool:
    """Whether the switch ``name`` is on: unset, or set to anything but :data:`OFF_VALUES`."""
    return os.environ.get(name, "1").strip().lower() not in OFF_VALUES
