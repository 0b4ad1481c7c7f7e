"""Two hosts on one machine: Linux network namespaces joined by a veth pair.

:func:`start` makes two network namespaces, each holding one end of a veth
pair with an address of its own (``10.231.0.1`` and ``.2``), and gives each
a host name through ``/etc/netns/<namespace>/hosts``, which ``ip netns
exec`` puts in place of ``/etc/hosts`` for every process it starts there.
That file maps the host's own name to ``127.0.1.1``, as Debian's installer
writes it: the "wrong interface" trap of real clusters, where a library
that binds the address of its own host name binds loopback. Each process a
test starts on a host (:meth:`TwoHosts.command`) also gets the host's name
from ``hostname``, in a UTS namespace of its own.

The namespaces share everything else with the machine: the file system (a
checkpoint directory is shared, as on a cluster with a shared file system),
the kernel, and so shared memory. MPICH's UCX would reach the other host
through that shared memory; :data:`MPI_ENV` keeps it to TCP, so the traffic
crosses the veth as it would cross a network.

Traffic stays between the two namespaces: the machine's own network is not
touched. :meth:`TwoHosts.stop` kills every process left in them and deletes
the namespaces and their ``/etc/netns`` directories. Needs root and
``iproute2`` (``make system-deps``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

#: The network between the two hosts; it exists only inside their namespaces.
SUBNET = "10.231.0"
#: Hydra's launcher enters the other host through this wrapper (:meth:`TwoHosts.hydra_args`).
#: UCX_TLS: MPICH's UCX netmod over TCP, not the shared memory two namespaces of one kernel could use.
MPI_ENV = {"UCX_TLS": "tcp,self"}
_ETC_NETNS = Path("/etc/netns")


def missing() -> list[str]:
    """Why two hosts cannot be made here: [] when they can."""
    why = []
    if os.geteuid() != 0:
        why.append("root (network namespaces)")
    for program in ("ip", "unshare", "hostname"):
        if shutil.which(program) is None:
            why.append(f"{program} (Debian iproute2/util-linux/hostname; `make system-deps`)")
    return why


@dataclass(frozen=True)
class NetHost:
    """One of the two hosts.

    Attributes:
        name: Its host name (what ``hostname`` prints there, and what the other host's ``/etc/hosts`` maps).
        netns: The network namespace that is its network.
        address: Its address on the link between the hosts.
        interface: The veth end it holds (named after the host, so each host's differs).
    """

    name: str
    netns: str
    address: str
    interface: str


def _ip(*args: str) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


@dataclass
class TwoHosts:
    """Two running hosts; processes started through :meth:`command` run on one of them."""

    a: NetHost
    b: NetHost
    workdir: Path

    @property
    def hosts(self) -> tuple[NetHost, NetHost]:
        return self.a, self.b

    def command(self, host: NetHost, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host``: in its network namespace, with its ``/etc/hosts`` and host name."""
        return [
            "ip", "netns", "exec", host.netns, "unshare", "--uts", "--",
            "/bin/sh", "-c", 'hostname "$0" && exec "$@"', host.name, *argv,
        ]  # fmt: skip

    def hydra_args(self) -> list[str]:
        """``mpiexec`` (MPICH's hydra) options that start the proxy of each host on that host.

        Hydra's ssh launcher runs ``LAUNCHER_EXEC [ssh options] HOST COMMAND``;
        the wrapper written here runs COMMAND on HOST through :meth:`command`
        instead of ssh. Run ``mpiexec`` itself on host a.
        """
        wrapper = self.workdir / "enter-host"
        if not wrapper.exists():
            cases = "".join(f"  {h.name}) netns={h.netns} ;;\n" for h in self.hosts)
            # ssh hands the remote shell its arguments joined by spaces (hydra quotes them for
            # that), so the command runs as `sh -c "$*"` there: here, on the host's namespace.
            wrapper.write_text(
                "#!/bin/sh\n"
                "# hydra's launcher-exec: [ssh options] HOST COMMAND... -> COMMAND on HOST (a network namespace)\n"
                'while [ "${1#-}" != "$1" ]; do shift; done\n'
                "host=$1; shift\n"
                "case $host in\n"
                f"{cases}"
                '  *) echo "enter-host: no host $host" >&2; exit 1 ;;\n'
                "esac\n"
                'exec ip netns exec "$netns" unshare --uts -- \\\n'
                '    /bin/sh -c \'hostname "$0" && exec /bin/sh -c "$*"\' "$host" "$@"\n'
            )
            wrapper.chmod(0o755)
        hosts = ",".join(f"{h.name}:2" for h in self.hosts)
        return ["-launcher", "ssh", "-launcher-exec", str(wrapper), "-hosts", hosts]

    def traffic(self, host: NetHost) -> int:
        """Bytes sent plus received so far by ``host``'s end of the link."""
        (link,) = json.loads(_ip("-n", host.netns, "-s", "-j", "link", "show", "dev", host.interface))
        stats = link["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])

    def pids(self, host: NetHost) -> list[int]:
        """The processes running on ``host`` (in its network namespace)."""
        return [int(p) for p in _ip("netns", "pids", host.netns).split()]

    def vanish(self, host: NetHost) -> None:
        """``host`` disappears as a machine does: its link goes down, then every process on it is killed.

        The link goes first, so its processes' sockets close without a word
        reaching the other host (no FIN, no RST): the other host learns of
        the loss only from its own timeouts.
        """
        _ip("-n", host.netns, "link", "set", "dev", host.interface, "down")
        self._kill(host)

    def restore(self, host: NetHost) -> None:
        """Bring ``host``'s link back up after :meth:`vanish` (its processes stay gone)."""
        self._kill(host)
        _ip("-n", host.netns, "link", "set", "dev", host.interface, "up")

    def _kill(self, host: NetHost) -> None:
        for _ in range(3):
            pids = self.pids(host)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def stop(self) -> None:
        """Kill what still runs on either host, delete both namespaces and their ``/etc/netns`` files."""
        for host in self.hosts:
            try:
                self._kill(host)
            except RuntimeError:
                pass  # the namespace is already gone
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=30, check=False)
            shutil.rmtree(_ETC_NETNS / host.netns, ignore_errors=True)


def start(workdir: Path) -> TwoHosts:
    """Make the two hosts (names unique to this process, so concurrent runs do not meet).

    Raises:
        RuntimeError: an ``ip`` command failed (its message says which).
    """
    tag = f"{os.getpid() % 100000}"
    a = NetHost(f"swhost{tag}-a", f"sw{tag}-a", f"{SUBNET}.1", f"sw{tag}a0")
    b = NetHost(f"swhost{tag}-b", f"sw{tag}-b", f"{SUBNET}.2", f"sw{tag}b0")
    hosts = TwoHosts(a, b, workdir)
    try:
        for host, other in ((a, b), (b, a)):
            _ip("netns", "add", host.netns)
            etc = _ETC_NETNS / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            # Debian's layout: the host's own name on 127.0.1.1, the other host by its address.
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {host.name}\n{other.address} {other.name}\n")
        _ip("link", "add", a.interface, "type", "veth", "peer", "name", b.interface)
        for host in (a, b):
            _ip("link", "set", host.interface, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.netns, "link", "set", "dev", host.interface, "up")
            _ip("-n", host.netns, "link", "set", "dev", "lo", "up")
    except BaseException:
        hosts.stop()
        raise
    return hosts
