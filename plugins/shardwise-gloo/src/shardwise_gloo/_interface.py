"""Which network interface gloo binds: the one that routes to the rendezvous host.

Without ``GLOO_SOCKET_IFNAME``, gloo binds the address this machine's host
name resolves to. Where ``/etc/hosts`` maps the host name to a loopback
address (Debian's ``127.0.1.1`` line, many container images), every rank
advertises a loopback address, and ranks on other hosts fail with
``failed to connect ... remote=[127.0.1.1]`` (pytorch/gloo#335). The
rendezvous host, by contrast, is by construction an address every rank can
reach, so the interface this host uses to reach it is the one to bind.

One host is special: the rendezvous host itself, where the name may resolve
to loopback. Its ranks learn from the store the address a rank on another
host reached from there, and bind the interface that routes to that
address; when no rank routes elsewhere, the whole job is on one host and
loopback is right.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from shardwise import LaunchInfo
from shardwise.errors import LaunchError

__all__ = ["IFNAME_ENV", "Route", "choose_interface", "interface_with_address", "route_to"]

_log = logging.getLogger("shardwise.session")

#: The variable torch's ProcessGroupGloo reads for the interface(s) to bind.
IFNAME_ENV = "GLOO_SOCKET_IFNAME"

# Store keys live under this prefix and the torchrun restart count (the agent store outlives a restart).
_PREFIX = "shardwise/gloo-interface"


@dataclass(frozen=True)
class Route:
    """How this host reaches an address.

    Attributes:
        host: The host as given (a name or an address).
        target: Its address, as this host resolves it.
        source: The address of this host the kernel sends from on the way there.
        interface: The network interface that holds ``source``; None where
            it cannot be told (not Linux).
    """

    host: str
    target: str
    source: str
    interface: Optional[str]

    @property
    def loopback(self) -> bool:
        """True when the route never leaves this host (the host resolves to a loopback address here)."""
        return ipaddress.ip_address(self.source.split("%", 1)[0]).is_loopback


def route_to(host: str, port: int) -> Route:
    """The route from this host to ``host`` (no packet is sent: a UDP socket is only connected).

    Raises:
        OSError: ``host`` does not resolve (``socket.gaierror``) or no
            interface routes to it (``ENETUNREACH``).
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        source = str(probe.getsockname()[0])
    return Route(host=host, target=str(address[0]), source=source, interface=interface_with_address(source))


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [
    ("next", ctypes.POINTER(_IfAddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockAddr)),
    ("netmask", ctypes.POINTER(_SockAddr)),
    ("broadaddr", ctypes.POINTER(_SockAddr)),
    ("data", ctypes.c_void_p),
]


def _address(sockaddr: _SockAddr) -> Optional[str]:
    """The IP address in a ``struct sockaddr`` (Linux layout), or None for another family."""
    if sockaddr.family == socket.AF_INET:  # sockaddr_in (16 bytes): family, port, address
        return socket.inet_ntop(socket.AF_INET, ctypes.string_at(ctypes.addressof(sockaddr), 16)[4:8])
    if sockaddr.family == socket.AF_INET6:  # sockaddr_in6 (28 bytes): family, port, flowinfo, address, scope
        return socket.inet_ntop(socket.AF_INET6, ctypes.string_at(ctypes.addressof(sockaddr), 28)[8:24])
    return None


def interface_with_address(address: str) -> Optional[str]:
    """The network interface that holds ``address`` (from ``getifaddrs``); None if none does or not on Linux.

    Linux only: the ``struct sockaddr`` layout read here is Linux's (BSDs
    put a length byte first).
    """
    if not sys.platform.startswith("linux"):
        return None
    wanted = ipaddress.ip_address(address.split("%", 1)[0])
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"getifaddrs: {os.strerror(errno)}")
    try:
        entry = head
        while entry:
            item = entry.contents
            if item.addr:
                found = _address(item.addr.contents)
                if found is not None and ipaddress.ip_address(found) == wanted and item.name is not None:
                    return str(item.name.decode())
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return None


def _unreachable(launch: LaunchInfo, host: str, exc: OSError) -> LaunchError:
    return LaunchError(
        f"rank {launch.rank}: no network interface of this host ({socket.gethostname()}) reaches the "
        f"rendezvous host {host!r} ({exc}), so gloo has no interface to bind. Set MASTER_ADDR to an "
        f"address of rank 0's host that every rank can reach, or {IFNAME_ENV} to the interface gloo "
        "should use (the same network on every host)."
    )


def choose_interface(
    launch: LaunchInfo, timeout: timedelta, *, route: Callable[[str, int], Route] = route_to
) -> Optional[Callable[[dist.Store], Optional[str]]]:
    """Plan the interface gloo binds; returns what to run once the rendezvous store is up, or None.

    Nothing is chosen when ``GLOO_SOCKET_IFNAME`` is set (the user's choice
    stands), for a job of one rank, or when no rendezvous host is known.
    Otherwise the route to the rendezvous host is found here, before any
    connection is tried, so that an unreachable host fails at once. The
    returned function finishes the choice on the store (see the module
    docstring), sets ``GLOO_SOCKET_IFNAME`` in this process, so later gloo
    groups (``torch.distributed.new_group`` included) bind the same
    interface, and returns the interface (None where it cannot be told).

    Args:
        launch: What the launcher said about this job.
        timeout: How long a rank on the rendezvous host waits for the
            others' routes.
        route: How to find a route (tests pass a fake).

    Raises:
        LaunchError: no interface of this host routes to the rendezvous host.
    """
    chosen = os.environ.get(IFNAME_ENV, "")
    if chosen:
        _log.debug("gloo binds %s, which %s names", chosen, IFNAME_ENV)
        return None
    if launch.world_size == 1 or launch.master_addr is None or launch.master_port is None:
        return None
    host, port = launch.master_addr, launch.master_port
    try:
        first = route(host, port)
    except OSError as exc:
        raise _unreachable(launch, host, exc) from exc
    one_host = launch.local_world_size is not None and launch.local_world_size == launch.world_size

    def finish(store: dist.Store) -> Optional[str]:
        final = first
        if not one_host and first.loopback:
            final = _route_from_rendezvous_host(store, launch, timeout, route) or first
        elif not one_host:
            store.set(_key("reachable"), first.source)  # an address another host reaches this host from
            _arrive(store, launch)
        if final.interface is None:
            _log.debug(
                "gloo: %s routes to %s from %s, but the interface holding that address is unknown "
                "here; gloo chooses by host name", host, final.target, final.source,
            )  # fmt: skip
            return None
        os.environ[IFNAME_ENV] = final.interface
        _log.debug(
            "gloo binds interface %s (address %s): the route to %s (%s) from this host; set %s to choose another",
            final.interface, final.source, final.host, final.target, IFNAME_ENV,
        )  # fmt: skip
        return final.interface

    return finish


def _key(name: str) -> str:
    return f"{_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


def _arrive(store: dist.Store, launch: LaunchInfo) -> str:
    """Count this rank in; the key set once every rank of this round has arrived.

    Rounds follow each other on one store (``init`` after ``destroy``
    meets the same torchrun agent store): the counter only grows, and
    arrival ``n`` belongs to round ``(n - 1) // world_size``.
    """
    arrivals = store.add(_key("arrived"), 1)
    done = _key(f"all/{(arrivals - 1) // launch.world_size}")
    if arrivals % launch.world_size == 0:
        store.set(done, "1")
    return done


def _route_from_rendezvous_host(
    store: dist.Store, launch: LaunchInfo, timeout: timedelta, route: Callable[[str, int], Route]
) -> Optional[Route]:
    """On the rendezvous host: the route to an address another host's rank left from, or None if none did.

    The address is any such rank's (each set it before it arrived); one
    left by an earlier round of the same job is as good.
    """
    reachable = _key("reachable")
    done = _arrive(store, launch)
    try:
        store.wait([done], timeout)
    except (RuntimeError, dist.DistError) as exc:
        raise LaunchError(
            f"rank {launch.rank} waited {timeout.total_seconds():g}s for every rank to reach the rendezvous "
            f"store and choose gloo's interface ({exc}); were all {launch.world_size} ranks started?"
        ) from exc
    if not store.check([reachable]):
        return None  # every rank routes over loopback: the job runs on one host
    remote = store.get(reachable).decode()
    try:
        return route(remote, launch.master_port or 0)
    except OSError as exc:
        raise _unreachable(launch, remote, exc) from exc
