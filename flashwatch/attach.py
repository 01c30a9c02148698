"""Find a model's attention layers and their query weights.

``find_attention(model, attention=None)``: every attention module in module order, with its
number of query heads and a function returning its query weight per head, W^Q as an
(H, D, C) tensor (head h's D rows of the query projection, d_model C columns). The families
found automatically (nanoGPT-style, Hugging Face GPT-2, Llama-style) are described in
``flashwatch.families``. Anything else: ``attention={module_name: query_weight_fn}`` with
``query_weight_fn(module) -> Tensor (H, D, C)``.

``select_layers`` keeps what ``MonitorConfig.layers`` selects. Routing the attention calls of
the found layers is ``flashwatch.routing``.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from .families import FAMILIES, Family, describe, match, nanogpt_width

QueryWeightFn = Callable[[nn.Module], torch.Tensor]  # module -> (H, D, C)

__all__ = ["AttentionLayer", "find_attention", "known_attention", "select_layers", "QueryWeightFn"]


def _rotates_queries(module: nn.Module) -> bool:
    """Whether a module of a rotary family turns its queries: Hugging Face's Llama-style attention
    takes ``position_embeddings=(cos, sin)`` in its forward (earlier versions held a ``rotary_emb``).
    A forward that could take them unnamed (``*args``, ``**kwargs``) or whose parameters cannot be
    read counts as rotating: its chain reads NaN, with a note, where a call names no rotation,
    rather than an error computed without it."""
    if hasattr(module, "rotary_emb"):
        return True
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return True
    return "position_embeddings" in params or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values())


@dataclass(eq=False)  # identity: a layer is one module
class AttentionLayer:
    """One attached attention layer.

    Attributes:
        index: the ``layer`` label (position in ``Monitor.layers``).
        name: the module's name in ``model.named_modules()``, without wrappers' steps (``named_modules``).
        module: the attention module.
        num_heads: query heads H.
        family: ``"nanogpt"``, ``"hf_gpt2"``, ``"hf_llama"`` or ``"explicit"`` (a query-weight function
            the user named, unless it names its family: ``flashwatch.sharded.QueryWeight``).
        mode: ``"own_kernel"`` or ``"observe"`` (auto_fix can move an observed layer to own_kernel).
        variant: the kernel variant in own_kernel mode; ``"sdpa"`` while observed.
        sdpa_fallback: why the layer's last own-kernel call ran torch SDPA instead of flashwatch's
            kernel (a call the kernel cannot take: ``flashwatch.call_support``), None where it ran the
            kernel (or the layer is observed). ``running_variant`` reports ``"sdpa"`` then.
        stats: the layer's ``AttentionStats`` (device tensors; reset after every monitored step).
        calls: attention calls measured during the current monitored step.
        coverage: CPU int64 tensor [attention calls, measured calls] of the current monitored
            step (counted by the router, also inside compiled graphs; reset by the Monitor).
        low_precision: whether the last measured call's output was BF16/FP16 (None before any).
        chain: the layer's W^Q-error accumulators (``flashwatch.chain.LayerChain``), None where
            that chain is not defined (explicitly named modules, layouts whose W^Q cannot be read).
        chain_input: the module's input at the current monitored call (the projection input X).
        chain_rotation: that call's rotary position embeddings (cos, sin) where the family's
            queries are rotated (None otherwise, or where the call names none).
        rotary: whether the module rotates its queries: its family does (``Family.rotary``) and
            its forward takes the call's ``position_embeddings`` or it holds a ``rotary_emb``
            (a module of Llama's layout without either does not rotate, so its X meets dQ as is).
        query_checked: whether the query of a monitored call (eager or compiled) was compared with W^Q X (once).
        query_mismatch: that comparison found the query is not W^Q X (a functional QK-norm, a
            query scale, an unannounced rotation): the W^Q-error readings are NaN from then on.
        placement: how this rank holds W^Q in a sharded model (``flashwatch.sharded.QueryPlacement``,
            from the query-weight function's ``placement``), None for a whole weight.
        head_offset: the global index of this rank's first head (tensor parallelism: ``num_heads``
            are this rank's heads, ``total_heads`` the layer's); 0 otherwise.
        total_heads: the layer's heads over all ranks (``num_heads`` unless tensor parallel).
        format: the number format of the layer's P_bar V product (``MonitorConfig.format``).
    """

    index: int
    name: str
    module: nn.Module
    num_heads: int
    query_weight_fn: QueryWeightFn = field(repr=False)
    family: str
    mode: str = "observe"
    variant: str = "sdpa"
    stats: Any = field(default=None, repr=False)
    calls: int = 0
    coverage: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.int64), repr=False)
    low_precision: bool | None = None
    chain: Any = field(default=None, repr=False)
    chain_input: Any = field(default=None, repr=False)
    chain_rotation: Any = field(default=None, repr=False)
    rotary: bool = field(default=False, init=False, repr=False)
    query_checked: bool = field(default=False, repr=False)
    query_mismatch: bool = field(default=False, repr=False)
    sdpa_fallback: str | None = field(default=None, repr=False)
    key: Any = field(default=None, repr=False)  # the compiled operators' key of this layer (kernels.ops.register_layer)
    format: str = "bf16"
    placement: Any = field(default=None, repr=False)
    head_offset: int = 0
    total_heads: int = 0

    def __post_init__(self):
        self.rotary = any(f.rotary for f in FAMILIES if f.name == self.family) and _rotates_queries(self.module)
        if self.placement is None:
            self.placement = getattr(self.query_weight_fn, "placement", None)
        if self.placement is not None and self.placement.heads_group is not None:  # tensor parallel
            self.head_offset = self.placement.head_offset
            self.total_heads = self.placement.shape[0]
        if not self.total_heads:
            self.total_heads = self.num_heads

    @property
    def running_variant(self) -> str:
        """What the layer's attention calls run: ``variant``, or ``"sdpa"`` where its own-kernel calls fall
        back to torch SDPA (``sdpa_fallback``), so a fix variant that cannot run is not reported as running."""
        return "sdpa" if self.sdpa_fallback is not None else self.variant

    @property
    def placement_kind(self) -> str:
        """``"whole"``, ``"fsdp"``, ``"tensor_parallel"`` or ``"unsupported"`` (``flashwatch.sharded``)."""
        return "whole" if self.placement is None else self.placement.kind

    def query_weight(self) -> torch.Tensor:
        """W^Q per head, (H, D, C), detached (a view of the parameter where the layout allows)."""
        w = self.query_weight_fn(self.module)
        return w.detach()

    def ensure_stats(self, device: torch.device):
        """The layer's stats on ``device`` (recreated if the model moved since attach)."""
        from flashwatch.kernels import AttentionStats

        if self.stats is None or self.stats.device != device:
            self.stats = AttentionStats(self.num_heads, device, format=self.format)
        return self.stats


# --- finding attention modules --------------------------------------------------------------

def _family_weight_fn(family: Family, shape: tuple[int, int, int]) -> QueryWeightFn:
    h, d, c = shape
    return lambda m: family.query_weight(m, h, d, c)


def _check_weight(name: str, w: Any, heads: int | None = None) -> int:
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"query weight of {name!r} must be a tensor (heads, head_dim, model_dim), got {shape}")
    if heads is not None and w.shape[0] != heads:
        raise ValueError(f"query weight of {name!r} has {w.shape[0]} heads, expected {heads}")
    return w.shape[0]


# Modules that wrap one module and add nothing to its name in the model: the attribute each holds it
# under (torch.compile; DDP and DataParallel; FSDP1; the activation-checkpoint wrapper FSDP1 runs use)
_WRAPPERS = {"OptimizedModule": "_orig_mod", "DistributedDataParallel": "module", "DataParallel": "module",
             "FullyShardedDataParallel": "_fsdp_wrapped_module", "CheckpointWrapper": "_checkpoint_wrapped_module"}


def wrapped(module: nn.Module) -> nn.Module | None:
    """The module ``module`` wraps, if it is one of ``_WRAPPERS``; else None."""
    attr = _WRAPPERS.get(type(module).__name__)
    inner = module._modules.get(attr) if attr is not None else None
    return inner if isinstance(inner, nn.Module) else None


def unwrapped(module: nn.Module) -> nn.Module:
    """``module`` without the wrappers around it (``_WRAPPERS``)."""
    while (inner := wrapped(module)) is not None:
        module = inner
    return module


def is_compiled_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns (an ``OptimizedModule``)."""
    return type(module).__name__ == "OptimizedModule" and wrapped(module) is not None


def _walk(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], dict[str, str]]:
    """The modules of ``model`` in ``named_modules()`` order without the wrappers (each wrapped module
    under the wrapper's name), and every ``named_modules()`` name (a wrapper's too) -> that name."""
    found: list[tuple[str, nn.Module]] = []
    names: dict[str, str] = {}
    seen: set[int] = set()

    def visit(module: nn.Module, raw: str, name: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        names[raw] = name
        inner = wrapped(module)
        if inner is not None:
            attr = _WRAPPERS[type(module).__name__]
            visit(inner, f"{raw}.{attr}" if raw else attr, name)
            return
        found.append((name, module))
        for part, child in module._modules.items():
            if child is not None:
                visit(child, f"{raw}.{part}" if raw else part, f"{name}.{part}" if name else part)

    visit(model, "", "")
    return found, names


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` as the model is without its wrappers (``_WRAPPERS``: torch.compile,
    DDP, FSDP1, checkpoint wrappers): a wrapped module is given, under the wrapper's name, in place
    of the wrapper. So a layer has one name however the model is wrapped, before or after attach
    (a saved state and ``MonitorConfig.layers`` apply across them), and hooks go on the module
    itself (a compiled wrapper's would run outside the compiled code)."""
    return _walk(model)[0]


def layer_names(model: nn.Module) -> dict[str, str]:
    """Every name of ``model.named_modules()`` (wrappers' included) -> its name in ``named_modules``."""
    return _walk(model)[1]


def submodule(model: nn.Module, name: str) -> nn.Module:
    """The module ``named_modules(model)`` calls ``name``, through any wrappers (``_WRAPPERS``).

    Raises:
        AttributeError: no such module.
    """
    module = unwrapped(model)
    for part in name.split(".") if name else ():
        child = module._modules.get(part)
        if child is None:
            raise AttributeError(f"{type(module).__name__} has no submodule {part!r}")
        module = unwrapped(child)
    return module


def find_attention(model: nn.Module, attention: Mapping[str, QueryWeightFn] | None = None
                   ) -> list[tuple[str, nn.Module, int, QueryWeightFn, str]]:
    """Attention modules of ``model`` in module order: (name, module, heads, query_weight_fn, family).

    Args:
        model: any ``nn.Module``.
        attention: optional ``{module_name: query_weight_fn}``; when given, exactly these
            modules are used (``query_weight_fn(module) -> (H, D, C)``).

    Raises:
        ValueError: no attention found (with what to do), an unknown module name, or a query
            weight function that does not return an (H, D, C) tensor.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = dict(named_modules(model))
    found = []
    if attention is not None:
        if not isinstance(attention, Mapping) or not attention:
            raise ValueError("attention must be a non-empty dict {module_name: query_weight_fn}, got "
                             f"{attention!r}")
        names = layer_names(model)  # a name with a wrapper's step in it (module., _orig_mod.) names its module
        attention = {names.get(n, n) if isinstance(n, str) else n: fn for n, fn in attention.items()}
        unknown = [n for n in attention if n not in modules]
        if unknown:
            raise ValueError(f"attention names {unknown} are not modules of the model; some module names: "
                             f"{[n for n in modules if n][:12]}")
        order = {n: i for i, n in enumerate(modules)}
        for name in sorted(attention, key=order.__getitem__):
            fn = attention[name]
            if not callable(fn):
                raise ValueError(f"attention[{name!r}] must be a function module -> (H, D, C) query weight, "
                                 f"got {type(fn).__name__}")
            heads = _check_weight(name, fn(modules[name]))
            # a function recognised from the model's structure (a sharded model's) names its family
            found.append((name, modules[name], heads, fn, getattr(fn, "family", None) or "explicit"))
        return found
    failures: list[str] = []
    for name, module, family, shape in known_attention(model, heads_from_call=True, failures=failures):
        fn = _family_weight_fn(family, shape)
        _check_weight(name, fn(module), shape[0])
        found.append((name, module, shape[0], fn, family.name))
    if not found:
        raise ValueError(_not_found_message(modules, failures))
    return found


def known_attention(model: nn.Module, heads_from_call: bool = False, failures: list[str] | None = None
                    ) -> list[tuple[str, nn.Module, Family, tuple[int, int, int]]]:
    """Modules of a known family in module order, by structure alone (no weight is read):
    (name, module, family, (H, D, C)). Children of an attention module are skipped.

    ``heads_from_call``: a module of nanoGPT's layout that names no head count gets it from one
    call of its forward on a (1, 2, C) zero input without gradients: the head dimension of the
    query it passes to ``torch.nn.functional.scaled_dot_product_attention`` (a module whose
    forward takes other arguments, or makes no such call, is not recognised; ``failures`` gets one
    line per such module saying why)."""
    out = []
    skip_prefix: str | None = None
    for name, module in named_modules(model):
        if skip_prefix is not None and name.startswith(skip_prefix):
            continue  # children of an attention module are not attention modules themselves
        hit = match(module)
        if hit is None and heads_from_call:
            hit = _match_from_call(name, module, failures if failures is not None else [])
        if hit is not None:
            out.append((name, module, *hit))
            skip_prefix = name + "."
    return out


def _match_from_call(name: str, module: nn.Module, failures: list[str]
                     ) -> tuple[Family, tuple[int, int, int]] | None:
    """nanoGPT's family and shape for a module of its layout that names no head count, the head
    count read from the query of one call of its forward (see ``known_attention``); where that
    fails, why, in ``failures``."""
    import torch.nn.functional as F

    c = nanogpt_width(module)
    weight = module.c_attn.weight if c is not None else None
    if weight is None or weight.is_meta:
        return None
    heads: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def record(q, *args, **kwargs):
        heads.append(q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else -1)
        return sdpa(q, *args, **kwargs)

    # the trial call leaves the run as it was: eval mode (no dropout, no running statistics) and
    # the random generators of the CPU and the weight's device put back afterwards
    training = [(m, m.training) for m in module.modules()]
    devices = [weight.device] if weight.device.type != "cpu" else []
    F.scaled_dot_product_attention = record
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type=weight.device.type):
            module.eval()
            module(torch.zeros(1, 2, c, device=weight.device, dtype=weight.dtype))
    except Exception as exc:  # a forward that needs more than x: not recognised (the error says how to name it)
        failures.append(f"{name or 'the model'}: its forward, called on a (1, 2, {c}) input to read the head count, "
                        f"raised {type(exc).__name__}: {str(exc)[:200]}")
        return None
    finally:
        F.scaled_dot_product_attention = sdpa
        for m, mode in training:
            m.training = mode
    if len(set(heads)) != 1 or heads[0] < 1 or c % heads[0]:
        failures.append(f"{name or 'the model'}: its forward's calls to scaled_dot_product_attention gave no single "
                        f"head count dividing {c} (query heads seen: {heads or 'none'})")
        return None
    family = next(f for f in FAMILIES if f.name == "nanogpt")
    return family, (heads[0], c // heads[0], c)


_QUERY_NAMES = ("q_proj", "query", "wq", "q", "to_q", "q_lin")  # a query projection on its own
_FUSED_NAMES = ("c_attn", "qkv", "in_proj", "qkv_proj", "Wqkv", "wqkv", "to_qkv", "query_key_value")


def _looks_like_attention(name: str, module: nn.Module) -> bool:
    """A module whose name or class mentions attention, or that holds a query projection."""
    if not list(module.children()):
        return False  # a projection itself, not the attention module
    words = (type(module).__name__ + " " + name.rsplit(".", 1)[-1]).lower()
    return ("attn" in words or "attention" in words or "mha" in words
            or any(n in _QUERY_NAMES + _FUSED_NAMES for n, _ in module.named_children()))


def _query_expression(module: nn.Module) -> str | None:
    """How a module's W^Q as (H, D, C) would be read, from its child projections (H left as H)."""
    children = dict(module.named_children())
    for name in _QUERY_NAMES:
        child = children.get(name)
        if isinstance(child, nn.Linear):
            c = child.in_features
            return f"m.{name}.weight.view(H, {child.out_features} // H, {c})"
    for name in _FUSED_NAMES:
        child = children.get(name)
        if isinstance(child, nn.Linear) and child.out_features % 3 == 0:
            c = child.in_features
            return f"m.{name}.weight[:{child.out_features // 3}].view(H, {child.out_features // 3} // H, {c})"
    packed = getattr(module, "in_proj_weight", None)  # nn.MultiheadAttention: q, k, v stacked in one parameter
    if isinstance(packed, torch.Tensor) and packed.dim() == 2 and packed.shape[0] % 3 == 0:
        c = packed.shape[0] // 3
        return f"m.in_proj_weight[:{c}].view(H, {c} // H, {packed.shape[1]})"
    return None


def _not_found_message(modules: dict, failures: Sequence[str] = ()) -> str:
    """What was found, and the ``attention=`` argument to write, with the model's own module names
    (and why modules of nanoGPT's layout that name no head count were not recognised)."""
    tried = (" Modules of nanoGPT's layout naming no head count were tried and not recognised: "
             + "; ".join(failures[:3]) + (f" (and {len(failures) - 3} more)" if len(failures) > 3 else "") + "."
             ) if failures else ""
    candidates = [(n, m) for n, m in modules.items() if n and _looks_like_attention(n, m)]
    # the outermost candidates only: an attention module's children are not attention modules
    outer = [(n, m) for n, m in candidates if not any(n.startswith(o + ".") for o, _ in candidates)]
    if not outer:
        names = [n for n in modules if n][:12]
        return (f"no attention layer found: flashwatch recognises {describe()}, and no module's name or class "
                f"mentions attention (some module names: {names}).{tried} Name the attention modules with "
                "attach(model, attention={'<module name>': lambda m: <its query weight as (heads, head_dim, "
                "model_dim)>, ...}), one entry per attention module (docs/GUIDE.md, 'Which models are found')")
    shown = []
    for n, m in outer[:6]:
        linears = ", ".join(f"{c}: Linear({l.in_features}, {l.out_features})" for c, l in m.named_children()
                            if isinstance(l, nn.Linear))
        shown.append(f"{n} ({type(m).__name__}{'; ' + linears if linears else ''})")
    more = f" and {len(outer) - 6} more" if len(outer) > 6 else ""
    expression = _query_expression(outer[0][1]) or "m.<query projection>.weight.view(H, D, C)"
    entries = ", ".join(f"{n!r}: query_weight" for n, _ in outer[:3]) + (", ..." if len(outer) > 3 else "")
    return (f"no attention layer found: flashwatch recognises {describe()}. Modules that look like attention: "
            f"{'; '.join(shown)}{more}.{tried} Name them with attach(model, attention=...), H being the number of "
            "query heads:\n"
            f"    query_weight = lambda m: {expression}\n"
            f"    monitor.attach(model, attention={{{entries}}})\n"
            "one entry per attention module (with Lightning: FlashWatchCallback(..., attention={...}), the names "
            "those of the LightningModule; docs/GUIDE.md, 'Which models are found')")


def select_layers(found: Sequence[tuple], layers: Any) -> list[tuple]:
    """Keep the entries of ``find_attention`` that ``MonitorConfig.layers`` selects.

    Args:
        found: ``find_attention``'s list.
        layers: None (all), a regex searched in the module names, or a list of module names and
            indices into ``found``.

    Raises:
        ValueError: nothing matched, or a listed name/index does not exist (the message lists
            what exists).
    """
    if layers is None:
        return list(found)
    names = [f[0] for f in found]
    if isinstance(layers, str):
        pattern = re.compile(layers)
        keep = [f for f in found if pattern.search(f[0])]
        if not keep:
            raise ValueError(f"MonitorConfig.layers={layers!r} matched none of the attention layers {names}")
        return keep
    chosen: set[int] = set()
    for item in layers:
        if isinstance(item, int):
            if item >= len(found):
                raise ValueError(f"MonitorConfig.layers: index {item} out of range; the model has {len(found)} "
                                 f"attention layers {names}")
            chosen.add(item)
        else:
            if item not in names:
                raise ValueError(f"MonitorConfig.layers: {item!r} is not an attention layer; found {names}")
            chosen.add(names.index(item))
    return [found[i] for i in sorted(chosen)]
