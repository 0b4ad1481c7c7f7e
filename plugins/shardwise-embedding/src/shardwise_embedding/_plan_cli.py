"""``shardwise plan``: plan the sharding of an embedding collection described in a JSON file.

The file holds the tables, as a JSON list of objects::

    [{"name": "t0", "embedding_dim": 64, "num_embeddings": 100000, "feature_names": ["f0"]},
     {"name": "t1", "embedding_dim": 16, "num_embeddings": 12, "pooling": "mean", "pooling_factor": 3}]

or as an object with the tables and, per table, constraints
(:class:`~shardwise_embedding._planner.ParameterConstraints`' fields)::

    {"tables": [...], "constraints": {"t0": {"sharding_types": ["row_wise"], "max_bytes_per_rank": "64MiB"}}}

A table's ``feature_names`` default to its name; ``pooling`` is ``"sum"``
(default) or ``"mean"``; ``pooling_factor`` is its mean ids per bag; ``dtype``
is ``"float32"`` (default), ``"float16"``, ``"bfloat16"`` or ``"float64"``.

Output: stdout carries one thing. Without ``--explain`` it is the plan's JSON
(what ``EmbeddingShardingPlan.from_json`` and ``shard_collection`` read);
with ``--explain`` it is the explanation. ``--output FILE`` writes the JSON
to FILE instead, so ``--explain --output plan.json`` gives both. Bad options
exit with status 2 (argparse's usage error); an unreadable or malformed file,
or tables that fit nowhere, exit with status 1 and one line on stderr saying
what to fix.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Optional

import torch

from shardwise_embedding._placement import OPTIMIZER_STATES
from shardwise_embedding._plan_data import PlanError
from shardwise_embedding._planner import EmbeddingShardingPlanner, ParameterConstraints
from shardwise_embedding._tables import EmbeddingBagConfig

__all__ = ["HELP", "add_arguments", "load_tables", "parse_size", "run"]

HELP = "plan how an embedding collection's tables are sharded (tables from a JSON file)"

_TABLE_KEYS = ("name", "embedding_dim", "num_embeddings", "feature_names", "pooling", "pooling_factor", "dtype")
_CONSTRAINT_KEYS = ("sharding_types", "ranks", "max_bytes_per_rank", "pooling_factor")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(i?)b?|(b?))\s*", re.IGNORECASE)


class _Bad(Exception):
    """Input the user must fix: its message is the one line ``shardwise plan`` prints."""


def parse_size(text: str) -> int:
    """Bytes from ``"536870912"``, ``"512MiB"``, ``"512M"`` (binary) or ``"0.5GB"`` (decimal).

    Raises:
        ValueError: not a size, or not positive.
    """
    m = _SIZE.fullmatch(str(text))
    if m is None:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with KiB, MiB, GiB (or KB, MB, GB)")
    number, unit, binary = float(m.group(1)), (m.group(2) or "").lower(), m.group(3)
    # "512M" and "512MiB" are binary; "512MB" is decimal.
    decimal = bool(unit) and not binary and str(text).strip().lower().endswith("b")
    size = int(number * (1000 ** ("kmgt".index(unit) + 1) if decimal else _UNITS[unit]))
    if size < 1:
        raise ValueError(f"{text!r} is not a positive size")
    return size


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``shardwise plan``'s arguments."""
    parser.description = (
        "Plan how each table of an embedding collection is sharded over a world of ranks, and why. "
        "TABLES is a JSON list of tables ({name, embedding_dim, num_embeddings, feature_names, pooling, "
        'pooling_factor, dtype}) or {"tables": [...], "constraints": {name: {sharding_types, ranks, '
        "max_bytes_per_rank, pooling_factor}}}. Prints the plan's JSON, or with --explain the explanation "
        "(with --output as well, the JSON goes to the file)."
    )
    parser.add_argument("tables", metavar="TABLES", help="the tables' JSON file ('-': standard input)")
    parser.add_argument("--world-size", type=_positive_int, required=True, help="ranks to shard over")
    parser.add_argument("--ranks-per-host", type=_positive_int, help="ranks per host (default: one host)")
    parser.add_argument("--memory-budget", type=_size, metavar="SIZE", help="bytes per rank, e.g. 512MiB or 2GiB")
    parser.add_argument("--batch-size", type=_positive_int, default=512, help="samples per rank and step (512)")
    parser.add_argument("--pooling-factor", type=float, default=1.0, help="mean ids per bag of a table (1)")
    parser.add_argument("--optimizer-state", choices=list(OPTIMIZER_STATES), default="adagrad",
                        help="the tables' optimizer, for its state's memory (adagrad)")  # fmt: skip
    parser.add_argument("--explain", action="store_true", help="print the explanation instead of the JSON")
    parser.add_argument("--output", metavar="FILE", help="write the plan's JSON to FILE")


def _table(i: int, entry: Any) -> tuple[EmbeddingBagConfig, Optional[float]]:
    where = f"table #{i}" + (f" ({entry.get('name')!r})" if isinstance(entry, dict) and "name" in entry else "")
    if not isinstance(entry, dict):
        raise _Bad(f"{where} is {type(entry).__name__}, not an object with name, embedding_dim and num_embeddings")
    unknown = sorted(set(entry) - set(_TABLE_KEYS))
    if unknown:
        raise _Bad(f"{where}: unknown keys {unknown}; a table takes {', '.join(_TABLE_KEYS)}")
    missing = [k for k in ("name", "embedding_dim", "num_embeddings") if k not in entry]
    if missing:
        raise _Bad(f"{where} lacks {', '.join(missing)}")
    features = entry.get("feature_names", [entry["name"]])
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise _Bad(f"{where}: feature_names must be a list of names, got {features!r}")
    dtype = entry.get("dtype", "float32")
    if dtype not in _DTYPES:
        raise _Bad(f"{where}: dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    try:
        config = EmbeddingBagConfig(
            name=entry["name"],
            embedding_dim=entry["embedding_dim"],
            num_embeddings=entry["num_embeddings"],
            feature_names=features,
            pooling=entry.get("pooling", "sum"),
            dtype=_DTYPES[dtype],
        )
    except (TypeError, ValueError) as exc:
        raise _Bad(f"{where}: {exc}") from None
    return config, entry.get("pooling_factor")


def _constraint(name: str, entry: Any) -> ParameterConstraints:
    if not isinstance(entry, dict):
        raise _Bad(f"constraints[{name!r}] is {type(entry).__name__}, not an object")
    unknown = sorted(set(entry) - set(_CONSTRAINT_KEYS))
    if unknown:
        raise _Bad(f"constraints[{name!r}]: unknown keys {unknown}; constraints take {', '.join(_CONSTRAINT_KEYS)}")
    fields = dict(entry)
    try:
        if isinstance(fields.get("max_bytes_per_rank"), str):
            fields["max_bytes_per_rank"] = parse_size(fields["max_bytes_per_rank"])
        return ParameterConstraints(**fields)
    except (ValueError, TypeError) as exc:
        raise _Bad(f"constraints[{name!r}]: {exc}") from None


def load_tables(data: Any) -> tuple[list[EmbeddingBagConfig], dict[str, ParameterConstraints], dict[str, float]]:
    """The tables, constraints and pooling factors a tables file holds (its parsed JSON).

    Raises:
        ValueError: the data is not of the form the module describes (the message says what to fix).
    """
    try:
        constraints: dict[str, ParameterConstraints] = {}
        if isinstance(data, dict):
            unknown = sorted(set(data) - {"tables", "constraints"})
            if unknown or "tables" not in data:
                raise _Bad(f"the object has keys {sorted(data)}; give 'tables' (a list) and optionally 'constraints'")
            cons = data.get("constraints", {})
            if not isinstance(cons, dict):
                raise _Bad("'constraints' must be an object mapping table names to constraints")
            constraints = {str(k): _constraint(str(k), v) for k, v in cons.items()}
            data = data["tables"]
        if not isinstance(data, list) or not data:
            raise _Bad('the tables must be a non-empty JSON list of objects (or {"tables": [...]})')
        tables, pooling = [], {}
        for i, entry in enumerate(data):
            config, factor = _table(i, entry)
            tables.append(config)
            if factor is not None:
                pooling[config.name] = factor
        return tables, constraints, pooling
    except _Bad as exc:
        raise ValueError(str(exc)) from None


def _fail(message: str) -> int:
    sys.stderr.write(f"shardwise plan: error: {' '.join(str(message).split())}\n")
    return 1


def run(args: argparse.Namespace) -> int:
    """Run ``shardwise plan`` with its parsed arguments; the exit status (1 with a one-line message on bad input)."""
    name = "standard input" if args.tables == "-" else args.tables
    try:
        if args.tables == "-":
            text = sys.stdin.read()
        else:
            with open(args.tables, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        return _fail(f"cannot read {name}: {reason}; pass a JSON file of tables")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return _fail(f"{name} is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); fix the file")
    try:
        tables, constraints, pooling = load_tables(data)
        planner = EmbeddingShardingPlanner(
            args.world_size,
            ranks_per_host=args.ranks_per_host,
            memory_budget_bytes=args.memory_budget,
            constraints=constraints,
            batch_size=args.batch_size,
            pooling_factors=pooling,
            default_pooling_factor=args.pooling_factor,
            optimizer_state=args.optimizer_state,
        )
        plan = planner.plan(tables)
    except (PlanError, ValueError, TypeError) as exc:
        return _fail(f"{name}: {exc}")
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as out:
                out.write(plan.to_json() + "\n")
        except OSError as exc:
            return _fail(f"cannot write {args.output}: {exc.strerror or exc}")
    if args.explain:
        sys.stdout.write(plan.explain() + "\n")
    elif not args.output:
        sys.stdout.write(plan.to_json() + "\n")
    return 0
