#!/usr/bin/env bash
# Debian packages that some tox envs need, installed with apt-get where they are
# missing (`make system-deps`; .ci/run calls it before `make test`):
#
#   openmpi-bin   Open MPI's mpirun (mpirun.openmpi) and libmpi.so.40, for tox env
#                 integration-openmpi (the mpi suites under a second MPI, beside
#                 MPICH from PyPI)
#   slurm-wlm     Slurm's daemons and commands (slurmctld, slurmd, srun, sbatch),
#   munge         and its authentication daemon, for tox env integration-slurm
#                 (the tests start and stop a one-node cluster themselves)
#   iproute2      `ip` (network namespaces and a veth pair), for tox env
#                 integration-two-hosts (two hosts on one machine)
#
# Needs root (or passwordless sudo) and apt-get. Where neither is available it
# says what is missing and exits 0: the envs that need the package then fail,
# naming it, rather than this script.
set -euo pipefail

PACKAGES=(openmpi-bin slurm-wlm munge iproute2)
# The file each package installs that the tests look for.
declare -A PROVIDES=([openmpi-bin]=/usr/bin/mpirun.openmpi [slurm-wlm]=/usr/sbin/slurmctld [munge]=/usr/sbin/munged
                     [iproute2]=/usr/bin/ip)

missing=()
for pkg in "${PACKAGES[@]}"; do
    [ -e "${PROVIDES[$pkg]}" ] || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "system-packages: all present (${PACKAGES[*]})"
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    sudo=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
else
    echo "system-packages: missing ${missing[*]}; install as root: apt-get install ${missing[*]}" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "system-packages: missing ${missing[*]} and no apt-get here; install them with your package manager" >&2
    exit 0
fi

echo "system-packages: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
