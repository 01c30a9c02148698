"""Attention inputs recorded from a real model for the bias lab: the real-failure recipe, at a few points of training.

``record_model_inputs`` trains the experiments' byte-level GPT (``research.experiments.model``)
on the Python standard library's source with the real-failure recipe's optimiser (AdamW, lr
3e-3 after a 200-step warm-up, betas (0.9, 0.95), clip 1.0; docs/EXPERIMENTS.md) and, at each of
the given steps, records one layer's attention inputs q, k, v (BF16, as the attention saw them)
and the gradient dO of its output on that step's batch. The lab measures every kernel on them
as on its synthetic inputs.

Sizes (``SIZES``): ``full`` is the recipe itself (6 layers, 6 heads, d=384, context 512, batch
32: a GPU); ``cpu`` the same recipe at a size a CPU trains in about a minute (2 layers, 2 heads of
64, context 256, batch 8, corpus 4 MB); ``quick`` a smoke size for tests. On CUDA the model
trains under BF16 autocast with torch SDPA (as the real-failure recipe); on the CPU the model is
FP32 with BF16 attention inputs (as the experiments' CPU scenario), with torch SDPA.

Command line (records to a file the lab reads with ``--model-inputs``)::

    python -m research.lab_inputs --size full --device cuda --steps 500,2000,3500 --out model_inputs.pt
"""

from __future__ import annotations

import argparse
import pickle
import sys
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

__all__ = ["SIZES", "DEFAULT_STEPS", "RecordedInputs", "record_model_inputs", "save", "load", "main"]


def _recipes():
    from research.experiments.scenarios import Recipe

    full = Recipe()  # the real-failure recipe
    return {
        "full": full,
        "cpu": replace(full, n_layer=2, n_head=2, n_embd=128, block_size=256, batch_size=8, corpus_bytes=4_000_000),
        "quick": replace(full, n_layer=2, n_head=1, n_embd=64, block_size=64, batch_size=4, warmup_steps=5,
                         corpus_bytes=1_000_000),
    }


SIZES = ("full", "cpu", "quick")
DEFAULT_STEPS = {"full": (500, 2000, 3500), "cpu": (100, 400, 800), "quick": (2, 10)}


@dataclass
class RecordedInputs:
    """One recorded attention call: q, k, v, dO (B, H, N, D) BF16 on the CPU, and where they came from."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    step: int
    layer: int
    size: str
    seed: int
    loss: float
    recipe: dict

    def describe(self) -> dict:
        """JSON-ready description (no tensors)."""
        return {"name": self.name, "source": "recorded", "step": self.step, "layer": self.layer, "size": self.size,
                "seed": self.seed, "loss": self.loss, "recipe": self.recipe, "shape": list(self.q.shape)}


class _Recorder:
    """Wraps ``F.scaled_dot_product_attention``: on an armed step, keeps call ``layer``'s inputs and dO."""

    def __init__(self, layer: int):
        self.layer, self.armed, self.calls, self.saved = layer, False, 0, {}
        self.original = F.scaled_dot_product_attention

    def __call__(self, q, k, v, *args, **kwargs):
        out = self.original(q, k, v, *args, **kwargs)
        if self.armed and self.calls == self.layer:
            self.saved = {"q": q.detach().to(torch.bfloat16).cpu(), "k": k.detach().to(torch.bfloat16).cpu(),
                          "v": v.detach().to(torch.bfloat16).cpu()}
            if out.requires_grad:
                out.register_hook(lambda g: self.saved.__setitem__("do", g.detach().to(torch.bfloat16).cpu()))
        self.calls += 1
        return out


def record_model_inputs(size: str = "cpu", steps=None, *, device: str = "cpu", seed: int = 0, layer: int = 1,
                        progress=None) -> list[RecordedInputs]:
    """Train the recipe of ``size`` to max(steps) and record layer ``layer``'s attention at each step.

    Returns one ``RecordedInputs`` per step (recorded before that step's optimizer update).
    """
    from flashwatch.tinygpt import stdlib_corpus
    from research.experiments.model import ExperimentGPT

    recipes = _recipes()
    if size not in recipes:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    r = recipes[size]
    steps = sorted(set(int(s) for s in (DEFAULT_STEPS[size] if steps is None else steps)))
    if not steps or steps[0] < 0:
        raise ValueError(f"steps must be non-negative integers, got {steps!r}")
    if not 0 <= layer < r.n_layer:
        raise ValueError(f"layer must be in 0..{r.n_layer - 1} for size {size!r}, got {layer}")
    dev = torch.device(device)
    torch.manual_seed(seed)
    data = stdlib_corpus(int(r.corpus_bytes))
    cuda = dev.type == "cuda"
    model = ExperimentGPT(r.n_layer, r.n_head, r.n_embd, r.block_size,
                          attn_dtype=None if cuda else torch.bfloat16).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(r.beta1, r.beta2), weight_decay=r.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    T, B = r.block_size, r.batch_size
    offsets = torch.arange(T + 1)
    rec = _Recorder(layer)
    out: list[RecordedInputs] = []
    F.scaled_dot_product_attention = rec
    try:
        for step in range(steps[-1] + 1):
            lr = r.lr * min(1.0, (step + 1) / max(1, r.warmup_steps))
            for group in opt.param_groups:
                group["lr"] = lr
            ix = torch.randint(data.numel() - T - 1, (B,), generator=gen)
            window = data[ix.unsqueeze(1) + offsets].long().to(dev)
            rec.armed, rec.calls, rec.saved = step in steps, 0, {}
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(window[:, :-1], window[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), r.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rec.armed:
                s = rec.saved
                out.append(RecordedInputs(f"model_{size}_s{step}", s["q"], s["k"], s["v"], s["do"], step, layer,
                                          size, seed, float(loss.detach()), r.to_dict()))
                if progress:
                    progress(f"recorded layer {layer} at step {step} (loss {float(loss.detach()):.3f})")
    finally:
        F.scaled_dot_product_attention = rec.original
    return out


def save(records: list[RecordedInputs], path: str) -> None:
    torch.save([asdict(r) for r in records], path)


def load(path: str) -> list[RecordedInputs]:
    try:
        items = torch.load(path, map_location="cpu", weights_only=True)
        return [RecordedInputs(**item) for item in items]
    except (OSError, RuntimeError, TypeError, KeyError, pickle.UnpicklingError) as exc:
        raise ValueError(f"{path}: not a file of recorded attention inputs (python -m research.lab_inputs): "
                         f"{type(exc).__name__}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.lab_inputs",
                                description="Record a real model's attention inputs for the bias lab (--model-inputs).")
    p.add_argument("--size", choices=SIZES, default="full")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", help="comma-separated steps (default: " +
                   "; ".join(f"{k}: {','.join(map(str, v))}" for k, v in DEFAULT_STEPS.items()) + ")")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layer", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        steps = None if args.steps is None else [int(s) for s in args.steps.split(",")]
        records = record_model_inputs(args.size, steps, device=args.device, seed=args.seed, layer=args.layer,
                                      progress=print)
    except ValueError as exc:
        print(f"python -m research.lab_inputs: {exc}", file=sys.stderr)
        return 2
    save(records, args.out)
    print(f"wrote {len(records)} recordings to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
