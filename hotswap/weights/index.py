"""The static map of a model's weights: checkpoint tensor name -> where it lands. Built once per model, O(1) per
name; names are never guessed by substring.

A checkpoint name maps to a `Target`: a parameter, the shard of it (for fused parameters: q/k/v in qkv_proj,
gate/up in gate_up_proj, from the model's `stacked_params_mapping`), and the owning module's `ShardedWeights`
layout. Parameters marked `hotswap_derived` (e.g. fp8 scales) are computed by post-processing, never loaded.
Aliases (a tied lm_head.weight) resolve to the canonical target.

A module may name its checkpoint tensors itself (`checkpoint_names(leaf)`, e.g. the fused MoE experts: one name
per expert and projection, and the fused [experts, ...] names a transformers 5 trainer yields). A name that is
not canonical `covers` the canonical shards it fills at once (a fused tensor covers every expert's shard): it is
never required, and sending it beside a canonical name it covers is a duplicate. An optional name covers nothing.
Such a module may also check an update's declaration as a whole (`check_update`, e.g. an fp8 weight needs its
scale beside it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from hotswap.weights.sharded import Narrowing, ShardedWeights, layout_of


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes."""

    param_name: str
    param: nn.Parameter
    shard_id: object
    module_name: str
    layout: ShardedWeights
    full_shape: tuple[int, ...]  # the full checkpoint tensor
    local_shape: tuple[int, ...]  # this rank's part (what a pre-sliced tensor must have)
    # the canonical keys it fills: None for a canonical name (its own key); () for an optional one (fp8 scales
    # of tensors that arrive quantized), which fills no key and is never required
    covers: tuple[tuple[str, object], ...] | None = None

    @property
    def key(self) -> tuple[str, object]:
        """Identifies the destination: two names with one key (tied weights) are the same weight."""
        return (self.param_name, self.shard_id)

    @property
    def keys(self) -> tuple[tuple[str, object], ...]:
        """The canonical destinations this tensor fills."""
        return (self.key,) if self.covers is None else self.covers

    def local_view(self) -> torch.Tensor:
        return self.layout.local_view(self.param, self.shard_id)

    def narrowings(self) -> Narrowing:
        return self.layout.narrowings(self.param, self.shard_id)


class WeightIndex:
    """Checkpoint name -> `Target` for one model, plus, per module, the targets it is made of (its
    post-processing runs once all of them arrived). `required` lists the canonical names a full load must fill."""

    def __init__(self, model: nn.Module) -> None:
        stacked: dict[str, tuple[str, object]] = getattr(model, "stacked_params_mapping", {})
        sources_of: dict[str, list[tuple[str, object]]] = {}
        for source, (fused, shard) in stacked.items():
            sources_of.setdefault(fused, []).append((source, shard))
        self.targets: dict[str, Target] = {}
        self.module_keys: dict[str, frozenset[tuple[str, object]]] = {}
        self.modules: dict[str, nn.Module] = {}  # the modules that own loaded parameters, by name
        for name, param in model.named_parameters():
            if getattr(param, "hotswap_derived", False):
                continue
            *module_path, leaf = name.split(".")
            module_name = ".".join(module_path)
            module = self.modules.setdefault(module_name, model.get_submodule(module_name))
            layout = layout_of(module)
            # (checkpoint name, shard id, the shard ids it covers: None for a canonical name)
            shards: list[tuple[str, object, tuple[object, ...] | None]] = [(name, None, None)]
            names_of = getattr(module, "checkpoint_names", None)
            if callable(names_of):
                shards = [(f"{module_name}.{rel}", shard, covers) for rel, shard, covers in names_of(leaf)]
            elif module_path and module_path[-1] in sources_of:
                parent = module_path[:-1]
                shards = [(".".join([*parent, src, leaf]), s, None) for src, s in sources_of[module_path[-1]]]
            for ckpt_name, shard, covers in shards:
                local = tuple(layout.local_view(param, shard).shape)
                full = tuple(layout.checkpoint_shape(param, shard))
                keys_covered = None if covers is None else tuple((name, c) for c in covers)
                self.targets[ckpt_name] = Target(name, param, shard, module_name, layout, full, local, keys_covered)
        keys: dict[str, set[tuple[str, object]]] = {}
        for target in self.targets.values():
            if target.covers is None:
                keys.setdefault(target.module_name, set()).add(target.key)
        self.module_keys = {module: frozenset(k) for module, k in keys.items()}
        self.required: frozenset[str] = frozenset(n for n, t in self.targets.items() if t.covers is None)
        # modules whose post-processing writes their parameters (the data is staged until then)
        self.staging_modules = frozenset(
            name for name, module in self.modules.items() if getattr(module, "stages_weights", False)
        )
        aliases_of = getattr(model, "checkpoint_aliases", None)
        aliases: dict[str, str] = aliases_of() if callable(aliases_of) else {}
        for alias, canonical in aliases.items():
            self.targets[alias] = self.targets[canonical]
        ignored = getattr(model, "ignored_checkpoint_names", None)
        self._ignored = ignored if callable(ignored) else (lambda name: False)
        # the keys whose full load makes the served weights valid again (see WeightUpdate.covers_all)
        self.validating_keys = frozenset(self.targets[n].key for n in self.required)
        self._scopes: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {}

    @classmethod
    def union(
        cls, parts: dict[str, tuple[WeightIndex, Callable[[], contextlib.AbstractContextManager[object]] | None]]
    ) -> WeightIndex:
        """One index over several models, each under a name prefix (e.g. "" for the target, "draft." for the
        draft model): its checkpoint names, parameters and modules are prefixed, so one update (one rollback, one
        commit) spans them all. A part's `scope` (when given) is entered around its modules' hooks (post-processing,
        declaration checks): a draft layer runs under the draft's config. Only the part with prefix "" makes the
        served weights valid again when fully loaded."""
        index = cls.__new__(cls)
        index.targets, index.module_keys, index.modules, index._scopes = {}, {}, {}, {}
        required: set[str] = set()
        staging: set[str] = set()
        validating: set[tuple[str, object]] = set()
        for prefix, (part, scope) in parts.items():
            for name, t in part.targets.items():
                covers = None if t.covers is None else tuple((prefix + p, s) for p, s in t.covers)
                index.targets[prefix + name] = replace(
                    t, param_name=prefix + t.param_name, module_name=prefix + t.module_name, covers=covers
                )
            for module_name, keys in part.module_keys.items():
                index.module_keys[prefix + module_name] = frozenset((prefix + p, s) for p, s in keys)
            for module_name, module in part.modules.items():
                index.modules[prefix + module_name] = module
                outer = part._scopes.get(module_name, scope)
                if outer is not None:
                    index._scopes[prefix + module_name] = outer
            required |= {prefix + n for n in part.required}
            staging |= {prefix + n for n in part.staging_modules}
            if prefix == "":
                validating |= part.validating_keys
        index.required, index.staging_modules = frozenset(required), frozenset(staging)
        index.validating_keys = frozenset(validating)
        ordered = sorted(parts.items(), key=lambda item: -len(item[0]))  # the longest matching prefix decides

        def ignored(name: str) -> bool:
            for prefix, (part, _) in ordered:
                if name.startswith(prefix):
                    return part.ignored(name[len(prefix) :])
            return False

        index._ignored = ignored
        return index

    def scope(self, module_name: str) -> contextlib.AbstractContextManager[object]:
        """The context a module's hooks run in (see `union`)."""
        scope = self._scopes.get(module_name)
        return scope() if scope is not None else contextlib.nullcontext()

    @classmethod
    def of(cls, model: nn.Module) -> WeightIndex:
        """The model's index, built on first use and kept on the model (the layout never changes after build)."""
        index = model.__dict__.get("_hotswap_weight_index")
        if index is None:
            index = cls(model)
            model.__dict__["_hotswap_weight_index"] = index
        return index

    def ignored(self, name: str) -> bool:
        """Checkpoint tensors the model does not load (e.g. rotary inv_freq buffers)."""
        return bool(self._ignored(name))
