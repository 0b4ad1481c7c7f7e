"""Jobs across two hosts: two network namespaces joined by a veth pair (:mod:`netns_hosts`).

Each host has its own address, host name and ``/etc/hosts``, whose line
``127.0.1.1 <own name>`` is the trap of real clusters: plain torch over gloo
binds loopback there and fails (the first test shows it). Through the real
launchers, with nothing telling gloo which interface to use:

* gloo: ``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`` on
  each host runs the README's sharded example, a reshard of every pair of
  six layouts (with node-local facts and a checkpoint in a shared
  directory), the README's embedding training and the demo's model; each
  rank binds its host's veth (its debug log says so) and the traffic
  crosses the veth.
* mpi: MPICH's ``mpiexec`` on host a starts host b's ranks through a
  launcher that enters b's namespace; 2 ranks per host, the same programs.
* A host that vanishes (its link down, its processes killed) ends the job
  on the other host within the timeout, under both launchers.

tox env ``integration-two-hosts`` runs it as root; elsewhere it skips,
saying what is missing. Every job has a hard timeout, after which every
process it started is killed; its full output is in the assertion message.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import netns_hosts
import pytest
from test_torchrun_gloo import PROGRAMS, _environment, _kill_job

if netns_hosts.missing():
    pytest.skip(f"two hosts need {', '.join(netns_hosts.missing())}", allow_module_level=True)
pytest.importorskip("shardwise_gloo", reason="shardwise-gloo is not installed in this env")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: Seconds one job may take: 4 ranks and 2 agents importing torch on a small machine.
JOB_TIMEOUT = 240
#: The group timeout of the vanishing-host jobs: the survivors must be done well within JOB_TIMEOUT.
PEER_TIMEOUT = 10
_ports = itertools.count(29400)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[netns_hosts.TwoHosts]:
    running = netns_hosts.start(tmp_path_factory.mktemp("hosts"))
    try:
        yield running
    finally:
        running.stop()


def _env(**extra: str) -> dict[str, str]:
    env = _environment(SHARDWISE_LOGS="session=debug", **extra)
    env.pop("GLOO_SOCKET_IFNAME", None)  # the point: nothing tells gloo which interface to use
    return env


class Job:
    """Processes started on the hosts at once; their output goes to files, read when they end."""

    def __init__(self, tmp: Path, commands: Sequence[list[str]], env: dict[str, str]) -> None:
        self.logs = [tmp / f"job-{next(_ports)}-{i}.log" for i in range(len(commands))]
        self.procs = []
        for cmd, log in zip(commands, self.logs, strict=True):
            with log.open("w") as out:
                self.procs.append(
                    subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
                )  # fmt: skip

    def output(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def wait_for(self, pattern: str, count: int, timeout: float) -> None:
        """Until ``pattern`` occurs ``count`` times in all outputs together."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(len(re.findall(pattern, self.output(i))) for i in range(len(self.logs))) >= count:
                return
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"{count} x {pattern!r} did not appear within {timeout:g}s:\n{self.report()}")

    def wait(self, timeout: float = JOB_TIMEOUT) -> list[int]:
        """Every process's exit status; all are killed and the test fails if one is still running after ``timeout``."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"the job did not finish within {timeout:g}s (killed):\n{self.report()}")
        print(self.report())
        return [p.returncode for p in self.procs]

    def kill(self) -> None:
        for proc in self.procs:
            _kill_job(proc.pid)
            proc.wait()

    def report(self) -> str:
        return "\n".join(
            f"----- {' '.join(p.args[-8:])} (exit {p.returncode}) -----\n{self.output(i)}"  # type: ignore[index]
            for i, p in enumerate(self.procs)
        )


def _torchrun(hosts: netns_hosts.TwoHosts, tmp: Path, program: Path, *args: str, **env: str) -> Job:
    """``torchrun --nnodes 2 --nproc-per-node 2`` on each host, rendezvous at host a (by name, as on a cluster)."""
    port = next(_ports)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.a.name}:{port}", "--rdzv-id", f"job{port}",
        "--max-restarts", "0", str(program), *args,
    ]  # fmt: skip
    return Job(tmp, [hosts.command(h, cmd) for h in hosts.hosts], _env(**env))


def _mpiexec(hosts: netns_hosts.TwoHosts, tmp: Path, program: Path, *args: str, **env: str) -> Job:
    """MPICH's ``mpiexec -n 4`` on host a, 2 ranks per host, host b entered through hydra's launcher."""
    pytest.importorskip("shardwise_mpi", reason="shardwise-mpi is not installed in this env")
    from shardwise.testing import find_mpiexec, mpiexec_kind

    mpiexec = find_mpiexec()
    if mpiexec_kind(mpiexec) != "mpich":
        pytest.skip(f"{mpiexec} is not MPICH's hydra (the launcher wrapper speaks hydra's -launcher-exec)")
    genv = [arg for name, value in netns_hosts.MPI_ENV.items() for arg in ("-genv", name, value)]
    cmd = [mpiexec, *hosts.hydra_args(), *genv, "-n", "4", sys.executable, str(program), *args]
    return Job(tmp, [hosts.command(hosts.a, cmd)], _env(**env))


def _ok(job: Job) -> str:
    codes = job.wait()
    assert codes == [0] * len(codes), f"exit statuses {codes}:\n{job.report()}"
    return "\n".join(job.output(i) for i in range(len(codes)))


def _assert_gloo_bound_the_veth(out: str, hosts: netns_hosts.TwoHosts) -> None:
    for host, ranks in ((hosts.a, (0, 1)), (hosts.b, (2, 3))):
        for rank in ranks:
            line = f"gloo binds interface {host.interface} (address {host.address})"
            assert f"[shardwise rank {rank}] DEBUG shardwise.session: {line}" in out, f"missing {line!r}:\n{out}"


def test_plain_torch_over_gloo_binds_loopback_and_fails_here(hosts: netns_hosts.TwoHosts, tmp_path: Path) -> None:
    # The trap this setup reproduces: without GLOO_SOCKET_IFNAME, gloo binds the address its host name
    # resolves to, 127.0.1.1, and ranks on the other host cannot connect to it.
    program = tmp_path / "plain_gloo.py"
    program.write_text(
        "import datetime, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=20))\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    job = _torchrun(hosts, tmp_path, program)
    codes = job.wait()
    out = job.report()
    assert codes != [0, 0], out
    assert "127.0.1.1" in out, out


def test_sharded_example_over_gloo_binds_each_hosts_veth(hosts: netns_hosts.TwoHosts, tmp_path: Path) -> None:
    before = hosts.traffic(hosts.a)
    out = _ok(_torchrun(hosts, tmp_path, PROGRAMS / "sharded_readme.py"))
    for rank in range(4):
        assert f"rank {rank} (gloo): ShardedTensor [13, 4]" in out, out
    assert "rank 0: gathered tensor equals the dense computation" in out, out
    _assert_gloo_bound_the_veth(out, hosts)
    assert hosts.traffic(hosts.a) > before, "no traffic crossed the veth"


def _assert_two_hosts_work(out: str, hosts: netns_hosts.TwoHosts, backend: str, ckpt: Path) -> None:
    layout = f"hosts {hosts.a.name}=[0, 1], {hosts.b.name}=[2, 3]"
    for rank in range(4):
        host, local = (hosts.a, rank) if rank < 2 else (hosts.b, rank - 2)
        on_host = [0, 1] if rank < 2 else [2, 3]
        facts = (
            f"rank {rank} on {host.name}: local rank {local} of 2, ranks on this host {on_host}, {layout}; "
            f"a CUDA backend would bind cuda:{local}"
        )
        assert facts in out, f"missing {facts!r}:\n{out}"
        assert f"rank {rank} ({backend}): 36 reshards between every pair of 6 layouts match" in out, out
        assert f"rank {rank}: checkpoint in {ckpt} saved by rows and loaded into reversed columns" in out, out


def test_every_reshard_node_local_facts_and_a_shared_checkpoint_over_gloo(
    hosts: netns_hosts.TwoHosts, tmp_path: Path
) -> None:
    ckpt = tmp_path / "shared-ckpt"
    out = _ok(_torchrun(hosts, tmp_path, PROGRAMS / "two_hosts.py", "work", str(ckpt)))
    _assert_two_hosts_work(out, hosts, "gloo", ckpt)
    _assert_gloo_bound_the_veth(out, hosts)


@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_embedding_training(hosts: netns_hosts.TwoHosts, tmp_path: Path, launcher: str) -> None:
    pytest.importorskip("shardwise_embedding", reason="the training program shards an nn.EmbeddingBag")
    start = _torchrun if launcher == "torchrun" else _mpiexec
    out = _ok(start(hosts, tmp_path, PROGRAMS / "embedding_bag_train.py"))
    for rank, rows in enumerate(("0..249", "250..499", "500..749", "750..999")):
        assert f"rank {rank}: rows {rows} match dense training" in out, out


def test_demo_model_on_four_ranks_over_gloo_resumes_over_mpi(hosts: netns_hosts.TwoHosts, tmp_path: Path) -> None:
    pytest.importorskip("shardwise_embedding", reason="the demo's sharded tables need shardwise-embedding")
    ckpt = tmp_path / "recsys"
    out = _ok(_torchrun(hosts, tmp_path, EXAMPLES / "recsys.py", "--tiny", "--checkpoint", str(ckpt)))
    assert "trained steps 0..11 on 4 ranks (gloo)" in out, out
    assert "the MLP is identical on all 4 ranks" in out and "dense reference: MATCH" in out, out
    out = _ok(_mpiexec(hosts, tmp_path, EXAMPLES / "recsys.py", "--tiny", "--resume", str(ckpt)))
    assert "trained steps 12..23 on 4 ranks (mpi)" in out, out
    assert "the MLP is identical on all 4 ranks" in out and "dense reference: MATCH" in out, out


def test_an_unreachable_rendezvous_host_fails_at_once_naming_the_fix(hosts: netns_hosts.TwoHosts) -> None:
    code = "import shardwise; shardwise.init(backend='gloo')"
    env = _env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="10.99.0.1", MASTER_PORT="29500", SHARDWISE_TIMEOUT="120")
    started = time.monotonic()
    result = subprocess.run(
        hosts.command(hosts.b, [sys.executable, "-c", code]), capture_output=True, text=True, env=env, timeout=120
    )
    took = time.monotonic() - started
    assert result.returncode != 0, result.stdout + result.stderr
    assert "LaunchError: rank 1: no network interface of this host" in result.stderr, result.stderr
    assert "'10.99.0.1'" in result.stderr and "Network is unreachable" in result.stderr, result.stderr
    assert "Set MASTER_ADDR" in result.stderr and "GLOO_SOCKET_IFNAME" in result.stderr, result.stderr
    assert took < 60, f"{took:.0f}s: the error must come before any connection is tried"


def _vanish_host_b(hosts: netns_hosts.TwoHosts, job: Job) -> tuple[list[int], str]:
    """Once every rank loops, host b vanishes; the exit statuses, and host a's output."""
    try:
        job.wait_for(r"rank \d on \S+: in the loop", 4, JOB_TIMEOUT)
        started = time.monotonic()
        hosts.vanish(hosts.b)
        codes = job.wait(PEER_TIMEOUT + 90)
        took = time.monotonic() - started
    finally:
        hosts.restore(hosts.b)
    # No word came from the vanished host (its link went down first): host a learnt of it from its timeout.
    assert PEER_TIMEOUT - 1 < took < PEER_TIMEOUT + 90, f"{took:.1f}s\n{job.report()}"
    return codes, job.output(0)


def test_a_vanished_host_ends_the_torchrun_job_on_the_other_within_the_timeout(
    hosts: netns_hosts.TwoHosts, tmp_path: Path
) -> None:
    job = _torchrun(hosts, tmp_path, PROGRAMS / "two_hosts.py", "loop", SHARDWISE_TIMEOUT=str(PEER_TIMEOUT))
    codes, out = _vanish_host_b(hosts, job)
    assert codes[0] != 0, job.report()
    for rank in (0, 1):
        lost = rf"rank {rank} on {hosts.a.name}: FAILED after losing a host: PeerLostError: .*Timed out waiting"
        assert re.search(lost, out), out


def test_sharded_example_and_every_reshard_over_mpi(hosts: netns_hosts.TwoHosts, tmp_path: Path) -> None:
    before = hosts.traffic(hosts.a)
    out = _ok(_mpiexec(hosts, tmp_path, PROGRAMS / "sharded_readme.py"))
    for rank in range(4):
        assert f"rank {rank} (mpi): ShardedTensor [13, 4]" in out, out
    ckpt = tmp_path / "shared-ckpt"
    out = _ok(_mpiexec(hosts, tmp_path, PROGRAMS / "two_hosts.py", "work", str(ckpt)))
    _assert_two_hosts_work(out, hosts, "mpi", ckpt)
    assert hosts.traffic(hosts.a) > before, "no traffic crossed the veth"


def test_a_vanished_host_ends_the_mpi_job_on_the_other_within_the_timeout(
    hosts: netns_hosts.TwoHosts, tmp_path: Path
) -> None:
    job = _mpiexec(hosts, tmp_path, PROGRAMS / "two_hosts.py", "loop", SHARDWISE_TIMEOUT=str(PEER_TIMEOUT))
    codes, out = _vanish_host_b(hosts, job)
    # The survivors block in MPI; a survivor's watchdog ends the job after the timeout with MPI_Abort(124).
    assert codes == [124], job.report()
    assert re.search(r"shardwise: rank [01] of 4: all_reduce .* has waited [\d.]+ s for its peers", out), out
