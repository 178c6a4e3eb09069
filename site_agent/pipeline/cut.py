"""Cutting any job's model into pipeline stages by module name, without rewriting the model.

This module owns the candidate units (runs of the ``state_dict`` starting at a cut point) and
their modules, a stage (the model with other stages' modules replaced by a :class:`PassThrough`)
and the stage as ``PipelineStage`` takes it (:class:`StageForward`: its section of the forward)
(docs/pipelines.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from site_agent.jobs.contract import first_tensor


class PassThrough(nn.Module):
    """Stands in, on one stage, for a module another stage holds (``module``, copied to the meta
    device: no memory, its attributes still readable; the module itself is left as it is).
    Called, it returns zeros shaped as that module's output, found by running the copy on the
    meta device once per input signature, or, when it cannot run there (or is not given), its
    first input unchanged."""

    def __init__(self, module: nn.Module | None = None) -> None:
        super().__init__()
        # Not registered as a submodule: no tensors of the stage, not moved by ``.to()``.
        self.__dict__["_shell"] = _meta_copy(module) if module is not None else None
        self.__dict__["_outputs"] = {}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            shell = self.__dict__.get("_shell")
            if shell is None:
                raise
            return getattr(shell, name)  # a model that reads, e.g., layers[0].self_attn

    def train(self, mode: bool = True) -> PassThrough:
        if self._shell is not None:
            self._shell.train(mode)
        return super().train(mode)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        key = (self.training, _hashable(spec), *(_signature(x) for x in leaves))
        if key not in self._outputs:
            self._outputs[key] = self._on_meta(args, kwargs)
        out = self._outputs[key]
        if out is None or not tensors:
            return first
        device = tensors[0].device
        return pytree.tree_map_only(
            torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device), out
        )

    def _on_meta(self, args: Any, kwargs: Any) -> Any:
        if self._shell is None:
            return None
        meta = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().to("meta"), (args, kwargs))
        try:
            with torch.no_grad():
                return self._shell(*meta[0], **meta[1])
        except Exception:  # an op without a meta kernel, a data-dependent shape: pass through
            return None


def _meta_copy(module: nn.Module) -> nn.Module | None:
    """A copy of ``module`` with its tensors on the meta device (``None`` if it cannot be
    made), sharing nothing with it."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    try:
        return copy.deepcopy(module, memo)
    except Exception:  # a module that cannot be copied: passes its first input through
        return None


def _hashable(spec: pytree.TreeSpec) -> Any:
    """``spec`` itself where it hashes by structure, else its text (in torch 2.7 a
    ``TreeSpec`` holding lists does not hash)."""
    try:
        hash(spec)
    except TypeError:
        return repr(spec)
    return spec


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.shape, value.dtype
    plain = (bool, int, float, str, type(None), torch.dtype, torch.device)
    return value if isinstance(value, plain) else type(value)


class _Leave(BaseException):
    """Ends a stage's forward at the next stage's entry (not an ``Exception``, so that no
    ``except Exception`` of the model's own code catches it)."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value


class _Section:
    """The hooks that bound a stage's section of the forward, and what they hand each other.
    Apart from the stage (which holds it), so that the model's hooks hold no reference to it."""

    def __init__(self, entry: str | None) -> None:
        self.entry = entry
        self.received: tuple[torch.Tensor, Callable[[], None]] | None = None

    def enter(self, _m: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        if torch._C._current_graph_task_id() != -1:
            raise ValueError(
                f"the stage's first module {self.entry!r} runs again in the backward (activation "
                "checkpointing around its call): checkpoint inside its forward instead"
            )
        if self.received is None:
            return None  # called again later in the forward
        (value, restore_rng), self.received = self.received, None
        restore_rng()  # what ran before drew nothing, as on the stage that ran it
        if args:
            return (value, *args[1:]), kwargs
        return args, {**kwargs, next(iter(kwargs)): value}

    @staticmethod
    def leave(_m: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        raise _Leave(first_tensor(args[0] if args else next(iter(kwargs.values()))))


class StageForward(nn.Module):
    """One stage for ``PipelineStage``: the (cut) model's own forward, run from the stage's
    ``entry`` module to the next stage's (``exit``).

    A stage after the first receives the activation, then the model's inputs it calls the model
    with: all of them when the first is an integer or bool tensor (token ids:
    ``hand_first``), else those beyond the first, the activation standing in for it. Before
    ``entry`` the other stages' modules (:class:`PassThrough`) and the code between them run
    only for what the forward computes on the side (masks, position ids, rotary embeddings); at
    ``entry`` the activation is put in as that module's first input (its first positional
    argument, else its first keyword argument), with the RNG state the stage began with. At
    ``exit`` the forward stops and that module's first input is the stage's output, handed on
    with the model's inputs (those beyond the first must be integer or bool tensors, as
    ``make_stage_plan`` requires). The last stage (``exit=None``) returns the model's output,
    reduced to one tensor by :func:`first_tensor`."""

    def __init__(
        self,
        model: nn.Module,
        *,
        entry: str | None = None,
        exit: str | None = None,
        hand_first: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.entry, self.exit, self.hand_first = entry, exit, hand_first
        self._section = _Section(entry)
        modules = dict(model.named_modules())
        if entry is not None:
            modules[entry].register_forward_pre_hook(self._section.enter, with_kwargs=True)
        if exit is not None:
            modules[exit].register_forward_pre_hook(_Section.leave, with_kwargs=True)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        model_inputs, section = inputs, self._section
        if self.entry is not None:
            received, *handed = inputs
            if received.is_leaf and received.requires_grad:
                # Torch's stage makes it a leaf: a copy, so that the model may change it in
                # place (an nn.ReLU(inplace=True) that begins the stage).
                received = received.clone()
            section.received = (received, _rng_restorer(received.device))
            # What runs before the entry may change its first input in place: not the received.
            first = () if self.hand_first else (received.detach().clone(),)
            model_inputs = (*first, *handed)
        try:
            out = first_tensor(self.model(*model_inputs))
        except _Leave as leave:
            out = leave.value
        finally:
            pending, section.received = section.received, None
        if pending is not None:
            raise ValueError(f"the stage's first module {self.entry!r} was not called")
        # The zero-bubble schedules detach a stage's output in place, which a view does not
        # allow (a Hugging Face causal LM's logits slice the hidden states a cut head passes);
        # and what a stage sends must be contiguous (a batch's ``ids[:, :-1]`` is not).
        if out._is_view() or not out.is_contiguous():
            out = out.clone(memory_format=torch.contiguous_format)
        if self.exit is None:
            return out
        handed_on = model_inputs if self.hand_first else model_inputs[1:]
        return (out, *(x.contiguous() for x in handed_on)) if handed_on else out


def _rng_restorer(device: torch.device) -> Callable[[], None]:
    """A function that puts back the RNG state of now (the CPU's, and ``device``'s if CUDA)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)

    return restore


@dataclass(frozen=True)
class Units:
    """The candidate units of a model, in ``state_dict`` order."""

    names: tuple[str, ...]
    """A name per unit: the cut point it starts at (``"<prefix>"`` for what precedes the first)."""
    tensors: tuple[tuple[str, ...], ...]
    """The ``state_dict`` names each unit holds."""

    def __len__(self) -> int:
        return len(self.names)

    def owned(self, unit_indices: Iterable[int]) -> set[str]:
        return {name for i in unit_indices for name in self.tensors[i]}


def _tensor_names(model: nn.Module) -> list[str]:
    """``state_dict`` names, a tensor held under two names (tied) counted under its first."""
    first: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        first.setdefault(id(tensor), name)
    return list(first.values())


def _under(name: str, module_name: str) -> bool:
    return not module_name or name == module_name or name.startswith(module_name + ".")


def default_cut_points(model: nn.Module) -> list[str]:
    """The entries of the model's longest ``nn.ModuleList`` or ``nn.ModuleDict`` (ties: the
    first in module order; without one, its longest ``nn.Sequential``, the model itself
    included) that hold tensors, and the first module after it that holds tensors (its suffix,
    e.g. final norm and head)."""

    def of(*kinds: type[nn.Module]) -> list[tuple[str, nn.Module]]:
        return [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, kinds) and any(_tensor_names(block) for block in m.children())
        ]

    lists = of(nn.ModuleList, nn.ModuleDict) or of(nn.Sequential)
    if not lists:
        raise ValueError(
            "the model has no nn.ModuleList, nn.ModuleDict or nn.Sequential of blocks to cut: "
            "give the job cut_points"
        )
    list_name, blocks = max(lists, key=lambda item: len(item[1]._modules))
    prefix = f"{list_name}." if list_name else ""
    points = [f"{prefix}{n}" for n, block in blocks.named_children() if _tensor_names(block)]
    names = _tensor_names(model)
    following = names[max(i for i, n in enumerate(names) if _under(n, list_name)) + 1 :]
    if following:  # the module holding the first tensor after the list, e.g. model.norm
        points.append(following[0].rsplit(".", 1)[0])
    return points


def units_of(model: nn.Module, cut_points: Sequence[str] | None = None) -> Units:
    """Split the model's tensors into units at ``cut_points`` (default: :func:`default_cut_points`).

    A cut point must name a module that holds tensors, and cut points must follow the model's
    ``state_dict`` order; ``ValueError`` otherwise.
    """
    points = list(cut_points) if cut_points else default_cut_points(model)
    modules = dict(model.named_modules())
    names = _tensor_names(model)
    starts: list[int] = []
    for point in points:
        if point not in modules:
            raise ValueError(f"cut point {point!r} is not a module of the model")
        first = next((i for i, n in enumerate(names) if _under(n, point)), None)
        if first is None:
            raise ValueError(f"cut point {point!r} holds no parameters or buffers")
        if starts and first <= starts[-1]:
            raise ValueError(f"cut point {point!r} comes before the one it follows")
        starts.append(first)
    unit_names = list(points)
    if starts[0] > 0:
        starts.insert(0, 0)
        unit_names.insert(0, "<prefix>")
    ends = [*starts[1:], len(names)]
    tensors = tuple(tuple(names[a:b]) for a, b in zip(starts, ends, strict=True))
    return Units(names=tuple(unit_names), tensors=tensors)


def _module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.state_dict(keep_vars=True).items())


def _unit_of_name(model: nn.Module, units: Units) -> dict[str, int]:
    """Each ``state_dict`` name's unit; a second name of a tied tensor (in no unit) goes with
    the other tensors of its module, or, without any, with the name before it."""
    unit = {n: i for i, names in enumerate(units.tensors) for n in names}
    full = [n for n, _ in _module_tensors(model)]
    of_module: dict[str, int] = {}
    for n in full:
        if n in unit:
            of_module.setdefault(n.rpartition(".")[0], unit[n])
    out, last = {}, 0
    for n in full:
        last = unit.get(n, last)
        out[n] = unit[n] if n in unit else of_module.get(n.rpartition(".")[0], last)
    return out


def _units_under(
    tensors: list[tuple[str, torch.Tensor]], path: str, unit_of_name: dict[str, int]
) -> set[int]:
    """The units of a module's ``tensors`` (``_module_tensors``; the module at ``path``)."""
    return {unit_of_name[f"{path}.{n}"] for n, _ in tensors}


def strip_to_stage(model: nn.Module, units: Units, stage_units: Sequence[int]) -> nn.Module:
    """Replace, in place, each module of the other stages' units (``unit_modules``) by a
    :class:`PassThrough`, and each of their tensors held directly by a module the stage enters
    (a ViT's position embedding on the model itself) by zeros that are no parameter and not in
    the ``state_dict``; returns ``model``. Modules without tensors stay. A module whose own
    tensors are split between stages, or a tensor tied across stages, is a ``ValueError``."""
    mine, unit_of_name = set(stage_units), _unit_of_name(model, units)
    names = _module_tensors(model)
    owned_ids = {id(t) for n, t in names if unit_of_name[n] in mine}
    foreign_ids = {id(t) for n, t in names if unit_of_name[n] not in mine}
    tied = [n for n, t in names if id(t) in owned_ids & foreign_ids]
    if tied:
        raise ValueError(
            f"a tensor tied under the names {tied} is cut across stages: untie it (a Hugging "
            "Face config's tie_word_embeddings = false) or keep its modules on one stage"
        )

    def visit(module: nn.Module, where: str) -> None:
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        own_ids = {id(t) for _, t in own}
        if own_ids & owned_ids and own_ids & foreign_ids:
            raise ValueError(f"module {where!r} is split between stages: cut at modules")
        for name, t in own:
            if id(t) in foreign_ids:
                delattr(module, name)
                module.register_buffer(name, torch.zeros_like(t.detach()), persistent=False)
        for child_name, child in list(module.named_children()):
            path = f"{where}.{child_name}" if where else child_name
            tensors = _module_tensors(child)
            ids = {id(t) for _, t in tensors}
            if ids.isdisjoint(foreign_ids):
                continue
            one_unit = len(_units_under(tensors, path, unit_of_name)) == 1
            container = isinstance(child, (nn.ModuleList, nn.ModuleDict))
            if ids <= foreign_ids and one_unit and not container:
                setattr(module, child_name, PassThrough(child))
            else:
                visit(child, path)

    visit(model, "")
    return model


def unit_modules(model: nn.Module, units: Units) -> list[dict[str, nn.Module]]:
    """Per unit, by name, the largest modules whose tensors all belong to it: what its time is,
    where a stage's section of the forward begins, what a :class:`PassThrough` stands in for."""
    unit_of_name = _unit_of_name(model, units)
    out: list[dict[str, nn.Module]] = [{} for _ in range(len(units))]

    def visit(module: nn.Module, where: str) -> None:
        for name, child in module.named_children():
            path = f"{where}.{name}" if where else name
            unit_ids = _units_under(_module_tensors(child), path, unit_of_name)
            if len(unit_ids) == 1 and not isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                out[unit_ids.pop()][path] = child
            elif unit_ids:
                visit(child, path)

    visit(model, "")
    return out
