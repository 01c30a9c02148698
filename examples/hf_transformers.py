"""flashwatch on Hugging Face transformers models (GPT-2 or Llama), built from a config: no downloads.

flashwatch finds ``GPT2Attention`` (fused ``c_attn`` Conv1D) and Llama-style attention
(``q_proj``, grouped-query attention) by itself; the model must use SDPA attention
(``attn_implementation="sdpa"``), whose ``torch.nn.functional.scaled_dot_product_attention``
calls flashwatch routes. In own-kernel mode, flashwatch's kernel runs every call, with its padding
or causal mask where the model passes one (``--pad``); calls with attention dropout run torch SDPA
instead (logged once) and are measured all but their delta error (the attention_coverage alert
says so). This example sets dropout to 0, so every call runs and is measured in full.

    pip install transformers              # or, from a flashwatch checkout: pip install ".[transformers]"
    python examples/hf_transformers.py --family llama --mode own_kernel --steps 30
    python examples/hf_transformers.py --family gpt2 --bf16
    python examples/hf_transformers.py --family gpt2 --compile   # torch.compile(model), measured the same way
    python examples/hf_transformers.py --mode own_kernel --compile --pad 9   # a left-padded batch: masks as tensors

Where a Hugging Face version passes its causal mask to SDPA as a tensor (some do under
``torch.compile``), observe mode sees that the mask is only the causal pattern and measures those
calls with its Triton pass, as calls without a mask; own-kernel mode runs them in its kernel with
the mask. Padding rows (``--pad``: every other sequence left-padded, its padding out of the loss)
are left out of the statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import time

import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.tinygpt import sample_batch, stdlib_corpus


def build(family: str, layers: int, heads: int, embd: int, block: int):
    """A small randomly initialised causal LM of the family, with SDPA attention."""
    import transformers

    transformers.logging.set_verbosity_error()
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_head=heads, n_embd=embd, n_positions=block, vocab_size=256,
                                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads,
                                       num_key_value_heads=max(1, heads // 2),  # grouped-query attention
                                       hidden_size=embd, intermediate_size=4 * embd, vocab_size=256,
                                       max_position_embeddings=block, bos_token_id=0, eos_token_id=0)
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "sdpa"
    return cls(cfg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--family", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--mode", choices=("observe", "own_kernel"), default="observe")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--bf16", action="store_true", help="train under BF16 autocast")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=128, help="model width; head dim = embd / heads must be one of 16, 32, 64, 128 (others run unmeasured)")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--compile", action="store_true", help="train torch.compile(model) (attach the Monitor first)")
    p.add_argument("--pad", type=int, default=0,
                   help="left-pad every other sequence by this many positions (an attention_mask; the loss leaves "
                        "the padding out)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (a model this small runs fastest on one, and stays fast on a busy machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    torch.manual_seed(0)
    model = build(args.family, args.layers, args.heads, args.embd, args.block)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = stdlib_corpus(2_000_000)
    monitor = Monitor(MonitorConfig(interval=args.interval, mode=args.mode, warmup=4, window=5))
    layers = monitor.attach(model)
    print("attached:", ", ".join(f"{l.index}={l.name} ({l.family}, {l.num_heads} heads)" for l in layers))
    run = torch.compile(model) if args.compile else model  # after attach: compiled code is measured too

    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.bf16 else contextlib.nullcontext
    start = time.perf_counter()
    for step in range(args.steps):
        x, _ = sample_batch(data, args.batch, args.block, generator=torch.Generator().manual_seed(step))
        attention_mask = torch.ones_like(x)
        attention_mask[1::2, :args.pad] = 0  # left padding: the model masks these keys in its attention
        labels = x.masked_fill(attention_mask == 0, -100)  # and the loss leaves them out
        with autocast():
            loss = run(input_ids=x, attention_mask=attention_mask, labels=labels).loss  # shifted in there
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        monitor.step(loss=loss.detach(), grad_norm=grad_norm)
        if step % 10 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    elapsed = time.perf_counter() - start

    snap = monitor.snapshot()
    print(f"\n{args.steps} steps in {elapsed:.1f} s; alerts: {len(monitor.alerts)}; errors: {monitor.errors}")
    print("attention run by:", {layer.index: layer.running_variant for layer in layers})
    def shown(metric: str, key: tuple, fmt: str) -> str:
        """A head's value, or "not measured" (NaN: never a number standing in for no value)."""
        value = snap[metric].get(key, math.nan)
        return format(value, fmt) if math.isfinite(value) else "not measured"

    for (layer, head), sigma in snap["flashwatch_wq_spectral_norm"].items():
        key = (layer, head)
        print(f"layer {layer} head {head}: W^Q norm {sigma:.3f}, drift z "
              f"{shown('flashwatch_delta_drift_z', key, '+.2f')}, max logit {shown('flashwatch_max_logit', key, '.2f')}, "
              f"W^Q-error coherence {shown('flashwatch_wq_error_coherence', key, '.2f')}")
    monitor.close()
    monitor.detach()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
