# shardwise monorepo: `make install` then `make test`.
#
# torch is always installed through constraints.txt (torch==2.13.0, the CPU
# build): an unpinned torch would pull the multi-GB CUDA build.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip

# Editable distributions installed into the dev venv.
DISTS := -e packages/shardwise[test] -e plugins/shardwise-gloo -e plugins/shardwise-nccl -e plugins/shardwise-mpi[mpich] \
         -e plugins/shardwise-embedding[test] -e plugins/shardwise-fsdp[test]
# tqdm and matplotlib: progress bars and the chart of `make demo` and `make bench`.
# import-linter: the core's import contracts (.importlinter), run by `make lint`.
# mkdocs-material and mkdocstrings[python]: the docs site (`make docs`).
DEV_TOOLS := tox ruff mypy import-linter pytest pytest-timeout hypothesis numpy tqdm matplotlib \
             "mkdocs-material>=9.5" "mkdocstrings[python]>=0.26"

# `make install` is re-run when any of these change.
INSTALL_INPUTS := Makefile constraints.txt $(wildcard packages/*/pyproject.toml plugins/*/pyproject.toml)
STAMP := $(VENV)/.install-stamp

LINT_PATHS := packages plugins integration_tests benchmarks examples
MYPY_PATHS := packages/shardwise/src/shardwise $(wildcard plugins/*/src)

.PHONY: install system-deps test lint docs demo demo-recsys bench bench-core bench-pipeline bench-mpi bench-embedding bench-collection bench-validation clean distclean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python $(INSTALL_INPUTS)
	$(PIP) install -c constraints.txt $(DISTS) $(DEV_TOOLS)
	touch $@

# Debian packages some tox envs need (Open MPI for integration-openmpi, Slurm and
# munge for integration-slurm, iproute2 for integration-two-hosts), installed
# with apt-get where missing; needs root. .ci/run calls it before `make test`.
system-deps:
	.ci/system-packages.sh

# The whole tox matrix, one env after another: the tests start several
# processes per test, so running envs in parallel on a small machine only
# makes timeouts likelier. Pass options with TOX_ARGS (TOX_ARGS="-e core").
#
# PRUNE_TOX_ENVS=1 (what .ci/run sets) runs the envs one by one and deletes
# each one's directory when it is done: every env holds its own ~1 GB copy of
# torch, and eight of them at once filled a CI machine's disk. It stops at
# nothing: every env runs, and the exit status is non-zero if any failed.
PRUNE_TOX_ENVS ?=
test: install
ifeq ($(PRUNE_TOX_ENVS),)
	$(BIN)/tox $(TOX_ARGS)
else
	@start=$$(date +%s); failed=""; \
	for env in $$($(BIN)/tox -l); do \
		$(BIN)/tox -e $$env $(TOX_ARGS) || failed="$$failed $$env"; \
		rm -rf .tox/$$env; \
	done; \
	echo "tox envs done in $$(( $$(date +%s) - start )) s; failed:$${failed:- none}"; \
	test -z "$$failed"
endif

# The main job (examples/dlrm.py): a DLRM-style click model with 26 Criteo-sized
# embedding tables (3 to 10^6 rows) and 13 dense features, its tables placed by
# the planner (which prints its plan and why) and trained on 2 MPI ranks, checked
# against the same training in one process without sharding, then resumed from
# its checkpoint on 3 ranks under a new plan. Sets everything up itself (the
# venv, MPICH from PyPI).
DEMO_CKPT := build/demo/dlrm-ckpt
demo: install
	$(BIN)/mpiexec -n 2 $(BIN)/python examples/dlrm.py --checkpoint $(DEMO_CKPT)
	$(BIN)/mpiexec -n 3 $(BIN)/python examples/dlrm.py --resume $(DEMO_CKPT)

# The first demo (examples/recsys.py): a recommendation model with a row-wise and
# a column-wise sharded nn.EmbeddingBag trained on 2 MPI ranks and checked against
# the same training in one dense process, then resumed from its checkpoint on
# 3 ranks.
RECSYS_CKPT := build/demo/recsys-ckpt
demo-recsys: install
	$(BIN)/mpiexec -n 2 $(BIN)/python examples/recsys.py --checkpoint $(RECSYS_CKPT)
	$(BIN)/mpiexec -n 3 $(BIN)/python examples/recsys.py --resume $(RECSYS_CKPT) --steps 100

# Every benchmark whose figures the performance targets name, then one checklist
# of all their targets (benchmarks/targets.py). Each step writes its table to
# benchmarks/results/:
# - bench.py, on 2 and 4 ranks: torch 2.13's _shard (gloo) vs shardwise over gloo
#   and over MPI, side by side: scatter, reshard, gather, full_tensor (64 MiB)
#   and the sharded embedding ops, with the floor (bytes moved / memcpy
#   bandwidth), raw mpi4py on the same bytes, and peak memory
#   (bench-<N>ranks.md and .png);
# - dtensor.py, on 2 and 4 ranks: DTensor over gloo and over the "mpi4py" torch
#   backend beside shardwise over both, and every collective of the two torch
#   backends (dtensor-<N>ranks.md);
# - pipeline.py, on 2 ranks: the demo's training, blocking loop vs
#   SparseDistPipeline, over MPI and gloo (pipeline-2ranks.md);
# - scale.py, one process: metadata work (validation, reshard planning,
#   checkpoint load planning) from 10 to 10^5 shards against torch 2.13, with a
#   log-log chart (scale.md, scale.png);
# - cross_memory.py, two processes: what one cross-memory-attach copy costs by
#   the far side's pages and layout, the figures behind box_moves' cost model
#   (cross-memory.md).
# - gloo_rounds.py, on 2 and 4 ranks: what one round of gloo costs by how the
#   ranks swap small rows (ring all-gather, all-to-all, shardwise's choice)
#   (gloo-rounds-<N>ranks.md);
# - copy_bounds.py, on 2 and 4 ranks: the copies of the scatter, gather and
#   reshard rows alone (no agreement, rounds or bookkeeping) at their best
#   split, beside shardwise and raw mpi4py: what bounds the movement targets
#   (copy-bounds-<N>ranks.md);
# - after_traffic.py, on 2 and 4 ranks: shardwise over MPI right after other
#   work (torch._shard's gloo reshard, gloo traffic, memory traffic) and 50 ms
#   later: what bench.py's interleaving costs its MPI column
#   (after-traffic-<N>ranks.md).
# `make bench-core RANKS=4` runs bench.py alone.
RANKS ?= 2
BENCH_RESULTS := benchmarks/results
bench: install
	$(BIN)/mpiexec -n 2 $(BIN)/python benchmarks/bench.py
	$(BIN)/mpiexec -n 4 $(BIN)/python benchmarks/bench.py
	$(BIN)/mpiexec -n 2 $(BIN)/python benchmarks/dtensor.py
	$(BIN)/mpiexec -n 4 $(BIN)/python benchmarks/dtensor.py
	$(BIN)/mpiexec -n 2 $(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/scale.py
	$(BIN)/python benchmarks/cross_memory.py
	$(BIN)/mpiexec -n 2 $(BIN)/python benchmarks/gloo_rounds.py
	$(BIN)/mpiexec -n 4 $(BIN)/python benchmarks/gloo_rounds.py
	$(BIN)/mpiexec -n 2 $(BIN)/python benchmarks/copy_bounds.py
	$(BIN)/mpiexec -n 4 $(BIN)/python benchmarks/copy_bounds.py
	$(BIN)/mpiexec -n 2 $(BIN)/python benchmarks/after_traffic.py
	$(BIN)/mpiexec -n 4 $(BIN)/python benchmarks/after_traffic.py
	$(BIN)/python benchmarks/targets.py $(BENCH_RESULTS)/bench-2ranks.md $(BENCH_RESULTS)/bench-4ranks.md \
		$(BENCH_RESULTS)/dtensor-2ranks.md $(BENCH_RESULTS)/dtensor-4ranks.md \
		$(BENCH_RESULTS)/pipeline-2ranks.md $(BENCH_RESULTS)/scale.md

bench-core: install
	$(BIN)/mpiexec -n $(RANKS) $(BIN)/python benchmarks/bench.py

# The demo's training, blocking loop vs SparseDistPipeline (see above).
bench-pipeline: install
	$(BIN)/mpiexec -n $(RANKS) $(BIN)/python benchmarks/pipeline.py

# Group collectives over MPI vs raw mpi4py (and over gloo), 2 ranks; writes
# benchmarks/results/mpi_collectives.md. Not part of `make test`.
bench-mpi: install
	$(BIN)/mpiexec -n 2 $(BIN)/python benchmarks/mpi_collectives.py

# Shard-metadata validation (overlaps, covering), torch 2.13 vs shardwise, 10 to 10^5 shards
# per layout, one process; writes benchmarks/results/validation.md. Not part of `make test`.
bench-validation: install
	$(BIN)/python benchmarks/validation.py

# Sharded embedding / embedding_bag: torch 2.13's _shard (gloo) vs shardwise
# over gloo and over MPI, 2 ranks; writes benchmarks/results/embedding.md.
bench-embedding: install
	$(BIN)/mpiexec -n 2 $(BIN)/python benchmarks/embedding.py

# The demo's DLRM model (examples/dlrm.py), one training step under five embedding
# layouts: the planner's plan, every table row-wise, every table table-wise (all by
# shard_collection, over gloo and over MPI), one shardwise sharded nn.EmbeddingBag
# per table, and torch 2.13's torch.distributed._shard per table (gloo): samples/s,
# bytes and collectives per rank and step; then a row-sparse optimizer step on a
# 10^7-row table against a dense torch.optim.Adagrad step. One mpiexec launch (gloo
# comes up through MPI); writes benchmarks/results/collection-<RANKS>ranks.md.
# `make bench-collection RANKS=4`. Not part of `make test`.
bench-collection: install
	$(BIN)/mpiexec -n $(RANKS) $(BIN)/python benchmarks/collection.py

# Every checker always runs; the target fails if any found something.
# lint-imports reads the import contracts from .importlinter (found in this,
# the repository root) over the editable installs in $(VENV); --no-cache: the
# graph takes well under a second. test_architecture.py (also part of `make
# test`) checks the whole core for import cycles and function-level imports.
# See docs/architecture.md.
ARCH_TEST := packages/shardwise/tests/test_architecture.py
lint: install
	@status=0; \
	echo "$(BIN)/ruff check $(LINT_PATHS)"; $(BIN)/ruff check $(LINT_PATHS) || status=1; \
	echo "$(BIN)/mypy $(MYPY_PATHS)"; $(BIN)/mypy $(MYPY_PATHS) || status=1; \
	echo "$(BIN)/lint-imports --no-logo --no-cache"; $(BIN)/lint-imports --no-logo --no-cache || status=1; \
	echo "$(BIN)/pytest -q -p no:cacheprovider $(ARCH_TEST)"; $(BIN)/pytest -q -p no:cacheprovider $(ARCH_TEST) || status=1; \
	exit $$status

# The docs site (mkdocs.yml, docs/; the API reference from the docstrings) into
# build/site. --strict: a broken link between pages, a link to a heading that is
# not there, or a docstring cross-reference that resolves to nothing fails the
# build. NO_MKDOCS_2_WARNING: mkdocs-material's banner about mkdocs 2, printed
# on every build, says nothing about these docs.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

# Build and test leftovers; `distclean` also removes the dev venv.
clean:
	rm -rf .tox .mypy_cache .ruff_cache .pytest_cache .hypothesis build dist $(STAMP)
	find packages plugins integration_tests -type d \
		\( -name __pycache__ -o -name '*.egg-info' -o -name build -o -name .pytest_cache \) \
		-prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
