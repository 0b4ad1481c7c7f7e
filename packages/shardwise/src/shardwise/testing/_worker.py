"""The child side of :func:`shardwise.testing.run_ranks` (``python -m``)."""

from __future__ import annotations

import faulthandler
import importlib
import os
import pickle
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import shardwise


def _rank() -> int:
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def main(spec_path: str) -> int:
    workdir = Path(spec_path).parent
    rank = _rank()
    log = open(workdir / f"log_{rank}.txt", "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    (workdir / f"pid_{rank}").write_text(str(os.getpid()))
    try:
        spec = pickle.loads(Path(spec_path).read_bytes())
        sys.path[:] = spec["sys_path"]
        target: Any = importlib.import_module(spec["module"])
        for part in spec["qualname"].split("."):
            target = getattr(target, part)
        if spec["backend"] is not None:
            shardwise.init(spec["backend"], timeout=spec["init_timeout"])
        result = target(*spec["args"], **spec["kwargs"])
        if spec["backend"] is not None:
            # Only on success: destroy waits for every rank, which a failed
            # run's peers may never reach.
            shardwise.destroy()
        tmp = workdir / f"result_{rank}.tmp"
        tmp.write_bytes(pickle.dumps(result))
        tmp.rename(workdir / f"result_{rank}.pkl")
        return 0
    except BaseException:
        text = traceback.format_exc()
        tmp = workdir / f"error_{rank}.tmp"
        tmp.write_text(text)
        tmp.rename(workdir / f"error_{rank}.txt")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
