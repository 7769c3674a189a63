"""The built-in engine's weights by name: loading received tensors, discarding (sleep level 2), re-allocating.

Names are the model's own ``named_parameters()`` names, tied weights included under every name they have (a
trainer may send ``lm_head.weight``, ``model.embed_tokens.weight`` or both; both land in the one shared tensor).
Persistent buffers can be loaded by name too. After :meth:`discard` every parameter is "unloaded" until a tensor
arrives for it (under any of its names). ``aliases`` adds names of the sender's for some parameters (under LoRA: the
adapter tensors' PEFT saved-adapter names -> the LoRA layers' parameters).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class NamedWeights:
    def __init__(self, model: torch.nn.Module, device: torch.device, aliases: dict[str, str] | None = None):
        self.device = device
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        self.aliases = dict(aliases or {})
        non_persistent = {
            f"{prefix}.{b}" if prefix else b
            for prefix, mod in model.named_modules()
            for b in getattr(mod, "_non_persistent_buffers_set", ())
        }
        self.buffers = {n: b for n, b in model.named_buffers() if n not in non_persistent}
        self._all_buffers = list(model.buffers())
        self._freed: list[tuple[torch.UntypedStorage, int]] = []
        # shape/dtype of each distinct parameter, for re-allocation after a discard
        self._shapes = {id(p): (tuple(p.shape), p.dtype) for p in self.params.values()}
        self._unloaded: set[int] = set()

    def _target(self, name: str) -> torch.Tensor | None:
        name = self.aliases.get(name, name)
        return self.params.get(name, self.buffers.get(name))

    def read_back(self, name: str) -> torch.Tensor | None:
        """The engine's tensor that a load of ``name`` filled (weight-sync verification reads it back)."""
        target = self._target(name)
        return None if target is None else target.data

    def check(self, named_shapes: Iterable[tuple[str, Sequence[int]]]) -> str | None:
        """A message naming every unknown name or shape mismatch, or ``None`` when all can be loaded."""
        unknown, mismatched = [], []
        for name, shape in named_shapes:
            target = self._target(name)
            if target is None:
                unknown.append(name)
                continue
            expected = self._shapes.get(id(target), (tuple(target.shape), None))[0]
            if tuple(shape) != expected:
                mismatched.append(f"{name} {tuple(shape)} != engine {expected}")
        problems = []
        if unknown:
            problems.append(f"unknown weight names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        if mismatched:
            problems.append(f"shape mismatches: {'; '.join(mismatched[:5])}{' ...' if len(mismatched) > 5 else ''}")
        return " and ".join(problems) or None

    @torch.no_grad()
    def load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into the weight of that name (dtype cast on the way; checked with :meth:`check`)."""
        for name, tensor in items:
            target = self._target(name)
            if target is None:  # check() names such weights before a sync; this is the same refusal, late
                raise KeyError(f"no engine weight named {name!r} (NamedWeights.check reports unknown names)")
            target.data.copy_(tensor)  # blocking: the sender's bucket may be reused next
            self._unloaded.discard(id(target))

    def discard(self) -> None:
        """Free every parameter's storage without copying it anywhere (sleep level 2).

        Storages are resized to 0 bytes (as FSDP does), so every alias of a parameter sees the memory go. Buffers
        that share a storage with parameters (after an offload cycle they live in one flat buffer) are moved out
        first: they are not weights a trainer sends, so they must survive."""
        storages: dict[int, torch.UntypedStorage] = {}
        for p in self.params.values():
            s = p.untyped_storage()
            if s.nbytes():
                storages[s.data_ptr()] = s
        with torch.no_grad():
            for b in self._all_buffers:
                if b.untyped_storage().nbytes() and b.untyped_storage().data_ptr() in storages:
                    b.data = b.data.clone()
        self._freed = []
        for s in storages.values():
            nbytes = s.nbytes()
            try:
                s.resize_(0)
                self._freed.append((s, nbytes))
            except RuntimeError:  # not allocated by torch (e.g. memory-mapped): swap the tensors out instead
                for p in self.params.values():
                    if p.untyped_storage().data_ptr() == s.data_ptr() and s.nbytes():
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._unloaded = set(self._shapes)

    def allocate(self) -> None:
        """Give discarded parameters uninitialised storage again (to be filled by a weight update)."""
        for s, nbytes in self._freed:
            s.resize_(nbytes)
        self._freed = []
        for p in self.params.values():
            shape, dtype = self._shapes[id(p)]
            if tuple(p.shape) != shape:  # swapped out by the fallback above
                p.data = torch.empty(shape, dtype=dtype, device=self.device)

    def unloaded(self) -> list[str]:
        """Names (one per distinct parameter) not loaded since the last :meth:`discard`."""
        seen, names = set(), []
        for name, p in self.params.items():
            if id(p) in self._unloaded and id(p) not in seen:
                seen.add(id(p))
                names.append(name)
        return names
