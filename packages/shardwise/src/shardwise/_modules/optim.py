"""``ShardedOptimizer``: a torch optimizer over the local shards of ShardedTensor parameters.

Optimizers act element-wise (SGD, Adam, Adagrad, ...), so each rank steps
the tensors it holds: every local shard of every ShardedTensor, and the
dense parameters. Unlike torch 2.13, ``state_dict``, ``load_state_dict`` and
``add_param_group`` work. The state dict is keyed by parameter name, and for
a shard by name and box (``"fc.weight[0:4, 0:8]"``), so each rank's dict says
which part of which tensor its state belongs to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable, Optional, Union

from torch import Tensor, optim

from shardwise._tensor.sharded_tensor import ShardedTensor

__all__ = ["ShardedOptimizer", "shard_key"]

TensorLike = Union[Tensor, ShardedTensor]


def shard_key(name: str, offsets: list[int], sizes: list[int]) -> str:
    """State-dict key of the shard of parameter ``name`` at ``offsets`` with ``sizes``: ``"w[0:4, 0:8]"``."""
    return f"{name}[{', '.join(f'{o}:{o + s}' for o, s in zip(offsets, sizes, strict=True))}]"


def _entries(name: str, value: Any) -> list[tuple[str, Tensor, dict[str, Any]]]:
    """``(key, tensor the optimizer steps, JSON-safe description)`` for one named parameter."""
    if isinstance(value, ShardedTensor):
        size = list(value.size())
        out = []
        for shard in value.local_shards():
            md = shard.metadata
            info = {"param": name, "offsets": list(md.shard_offsets), "sizes": list(md.shard_sizes), "size": size}
            out.append((shard_key(name, md.shard_offsets, md.shard_sizes), shard.tensor, info))
        return out
    if isinstance(value, Tensor):
        return [(name, value, {"param": name, "size": list(value.size())})]
    raise TypeError(f"parameter {name!r} must be a Tensor or ShardedTensor, got {type(value).__name__}")


def _named_items(params: Any, group_index: int) -> list[tuple[str, Any]]:
    """``(name, tensor)`` pairs of a param group's ``params``: a mapping, a tensor, or an iterable."""
    if isinstance(params, Mapping):
        items = list(params.items())
        for name, _ in items:
            if not isinstance(name, str):
                raise TypeError(f"parameter names must be str, got {name!r}")
        return items
    if isinstance(params, Tensor):
        params = [params]
    if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise TypeError(
            "params must be a mapping of name to Tensor/ShardedTensor, or an iterable of them, "
            f"got {type(params).__name__}"
        )
    items = []
    for j, p in enumerate(params):
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            items.append(p)  # (name, tensor) pairs, as named_parameters() yields
        else:
            items.append((f"param_groups[{group_index}][{j}]", p))
    return items


class ShardedOptimizer(optim.Optimizer):
    """Wrap ``optimizer_class`` over the local shards of ShardedTensors and the dense parameters.

    Args:
        named_params: Name to ``Tensor`` or ``ShardedTensor`` (for example
            ``dict(named_params_with_sharded_tensor(model))``).
        optimizer_class: The torch optimizer to run locally (``torch.optim.SGD``).
        *optimizer_args: Passed to ``optimizer_class``.
        **optimizer_kwargs: Passed to ``optimizer_class``.

    Raises:
        TypeError: a value is neither a Tensor nor a ShardedTensor.
        ValueError: two parameters would get the same state-dict key.
    """

    def __init__(
        self,
        named_params: Mapping[str, TensorLike],
        optimizer_class: Callable[..., optim.Optimizer],
        *optimizer_args: Any,
        **optimizer_kwargs: Any,
    ) -> None:
        # The base class's __init__ is not called (as in torch 2.13): the
        # wrapped optimizer owns the param groups and the state.
        self._keys: dict[int, str] = {}
        self._info: dict[str, dict[str, Any]] = {}
        items = _named_items(named_params, 0)
        tensors = self._register(items)
        self.named_params = dict(named_params)
        self._group_names = [[name for name, _ in items]]
        self._optim = optimizer_class(tensors, *optimizer_args, **optimizer_kwargs)

    def _register(self, items: list[tuple[str, Any]]) -> list[Tensor]:
        """Record state-dict keys for ``items``; return the tensors to optimize."""
        entries = [entry for name, value in items for entry in _entries(name, value)]
        keys: dict[int, str] = {}
        owner: dict[str, int] = {}
        for key, tensor, _ in entries:
            if key in self._info or owner.get(key, id(tensor)) != id(tensor):
                raise ValueError(f"two parameters have the state-dict key {key!r}; give them distinct names")
            owner[key] = id(tensor)
            keys[id(tensor)] = key
        self._keys.update(keys)
        self._info.update({key: info for key, _, info in entries})
        return [tensor for _, tensor, _ in entries]

    # The wrapped optimizer may replace these lists (load_state_dict does).
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (of local tensors)."""
        return self._optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optim.param_groups = value

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-tensor state."""
        return self._optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optim.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self._optim.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optim.defaults = value

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self._optim!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the local tensors (to None by default)."""
        self._optim.zero_grad(set_to_none)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimization step of every local tensor; returns the closure's loss, if any."""
        return self._optim.step(closure)

    def group_param_names(self) -> list[list[str]]:
        """The parameter names of each param group, the same on every rank.

        The wrapped optimizer's groups hold only this rank's local shards,
        so a parameter none of whose shards lives here is absent from them;
        its name is still listed here, where it was given.
        """
        return [list(names) for names in self._group_names]

    def _index_keys(self) -> list[list[str]]:
        return [[self._keys[id(p)] for p in group["params"]] for group in self._optim.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state, keyed by parameter name (and shard box).

        Returns:
            ``{"state": {key: {...}}, "param_groups": [{..., "params": [key, ...]}],
            "params": {key: {"param": name, "size": [...], "offsets": [...], "sizes": [...]}}}``;
            ``offsets``/``sizes`` are present for shards of ShardedTensors.
            Only the tensors of the state are not JSON data.
        """
        inner = self._optim.state_dict()
        index_to_key: dict[int, str] = {}
        for group, keys in zip(inner["param_groups"], self._index_keys(), strict=True):
            for index, key in zip(group["params"], keys, strict=True):
                index_to_key.setdefault(index, key)
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": keys}
            for group, keys in zip(inner["param_groups"], self._index_keys(), strict=True)
        ]
        state = {index_to_key.get(k, k) if isinstance(k, int) else k: v for k, v in inner["state"].items()}
        used = {key for keys in self._index_keys() for key in keys}
        return {"state": state, "param_groups": groups, "params": {k: dict(self._info[k]) for k in used}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict` saved with the same parameters, groups and sharding.

        Args:
            state_dict: What :meth:`state_dict` returned (on this rank).

        Raises:
            ValueError: the groups, the parameter keys (names and shard
                boxes) or the parameters' sizes differ from this
                optimizer's; the message lists the differences.
            KeyError: ``state`` or ``param_groups`` is missing.
        """
        for field in ("state", "param_groups"):
            if field not in state_dict:
                raise KeyError(f"ShardedOptimizer state dict has no {field!r}; pass what state_dict() returned")
        saved_groups = state_dict["param_groups"]
        current = self._index_keys()
        if len(saved_groups) != len(current):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter group(s), this optimizer has {len(current)}"
            )
        problems = []
        for g, (saved, keys) in enumerate(zip(saved_groups, current, strict=True)):
            missing = sorted(set(keys) - set(saved["params"]))
            unexpected = sorted(set(saved["params"]) - set(keys))
            if missing or unexpected:
                problems.append(f"group {g}: missing {missing}, unexpected {unexpected}")
        saved_info = state_dict.get("params", {})
        for key, info in saved_info.items():
            if key in self._info and info.get("size") != self._info[key].get("size"):
                problems.append(f"{key!r} had size {info.get('size')}, now {self._info[key].get('size')}")
        stray = sorted(str(k) for k in state_dict["state"] if k not in self._info)
        if stray:
            problems.append(f"state for unknown keys {stray}")
        if problems:
            raise ValueError(
                "ShardedOptimizer state dict does not match this optimizer's parameters and sharding (load it "
                "on the same rank, with the same names, specs and param groups): " + "; ".join(problems)
            )
        # Index by position in this optimizer's groups: the wrapped load_state_dict pairs them in order.
        position: dict[str, int] = {}
        inner_groups = []
        flat = 0
        for saved, keys in zip(saved_groups, current, strict=True):
            ids = []
            for key in keys:
                position.setdefault(key, flat)
                ids.append(position[key])
                flat += 1
            inner_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        inner_state = {position[k]: v for k, v in state_dict["state"].items()}
        self._optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})

    def add_param_group(self, param_group: Mapping[str, Any]) -> None:
        """Add a param group; ``params`` may name its tensors.

        Args:
            param_group: A dict with ``"params"`` (a mapping of name to
                Tensor/ShardedTensor, an iterable of tensors, ShardedTensors
                or ``(name, tensor)`` pairs) and optional hyperparameters.
                Unnamed tensors get the key ``"param_groups[G][J]"``.

        Raises:
            TypeError: ``param_group`` is not a dict with ``"params"``.
            ValueError: a key is already used, or the wrapped optimizer
                rejects the group (a tensor already in another group).
        """
        if not isinstance(param_group, Mapping) or "params" not in param_group:
            raise TypeError(f"param_group must be a dict with a 'params' entry, got {param_group!r}")
        items = _named_items(param_group["params"], len(self._optim.param_groups))
        saved_keys, saved_info = dict(self._keys), dict(self._info)
        tensors = self._register(items)
        try:
            self._optim.add_param_group({**param_group, "params": tensors})
        except Exception:
            self._keys, self._info = saved_keys, saved_info
            raise
        self.named_params.update({name: value for name, value in items})
        self._group_names.append([name for name, _ in items])
