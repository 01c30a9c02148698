"""Helpers of tests/test_sharded.py: rank workers for FSDP2, FSDP1, tensor parallelism and FSDP2 over
tensor parallelism on the CPU (gloo), each run beside an unsharded run of the same model on the
same global batch.

Without Lightning, so that the spawned processes import only torch and flashwatch.
"""

from __future__ import annotations

import datetime
import importlib.util
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from flashwatch import Monitor, MonitorConfig
from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

STEPS = 3
BATCH = 2  # sequences per rank (the unsharded run takes both ranks' sequences at once)
SEQ = 32


class LlamaStyleAttention(nn.Module):
    """Separate q/k/v projections, heads read from the projection (``view(B, T, -1, D)``), so the
    module runs unchanged on a tensor-parallel rank that holds some of the heads."""

    def __init__(self, width: int, heads: int, head_dim: int):
        super().__init__()
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)
        self.num_heads, self.head_dim = heads, head_dim

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class LlamaStyleBlock(nn.Module):
    def __init__(self, width, heads, head_dim):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = LlamaStyleAttention(width, heads, head_dim)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LlamaStyleLM(nn.Module):
    def __init__(self, width=48, heads=3, head_dim=16, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(256, width)
        self.h = nn.ModuleList([LlamaStyleBlock(width, heads, head_dim) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, 256, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class HFGPT2(nn.Module):
    """Hugging Face GPT-2 (``Conv1D`` c_attn of (C, 3C): FSDP2's dim-0 shard splits W^Q's input
    columns, so every head is split across the ranks) with the ``model(x, y) -> (_, loss)`` call."""

    def __init__(self):
        super().__init__()
        import transformers

        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=256,
                                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        cfg._attn_implementation = "sdpa"
        self.lm = transformers.GPT2LMHeadModel(cfg)

    def forward(self, idx, targets):
        return None, self.lm(input_ids=idx, labels=targets).loss


def nanogpt(block_size: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=block_size))


# block_size 1280 only enlarges the position table, so that FSDP1's flat shard boundary (half of all
# parameters, with the model wrapped as one unit) falls inside layer 0's query rows, mid-row
FSDP1_BLOCK_SIZE = 1280


def batches(rank: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's batch of one rank (None: both ranks' sequences, as the unsharded run sees them)."""
    data = stdlib_corpus(100_000)
    out = []
    for t in range(STEPS):
        parts = [sample_batch(data, BATCH, SEQ, generator=torch.Generator().manual_seed(1000 * t + r))
                 for r in ((0, 1) if rank is None else (rank,))]
        out.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    return out


def train(model: nn.Module, monitor: Monitor, data, *, clip: bool = True, resume_at: int | None = None) -> dict:
    """STEPS optimizer steps, all monitored; each step's snapshot and W^Q estimates.

    ``resume_at``: after that step, the Monitor is replaced by a new one loaded from rank 0's
    ``state_dict()`` (as a checkpoint written by rank 0 and read by every rank would)."""
    monitor.attach(model)
    kinds = [layer.placement_kind for layer in monitor.layers]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # large steps: W^Q moves, the iteration must follow
    records = []
    for x, y in data:
        loss = model(x, y)[1]
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9) if clip else None
        # the gradients' global norm where they are plain tensors (the unsharded reference runs)
        plain = all(not hasattr(p.grad, "to_local") for p in model.parameters() if p.grad is not None)
        true_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                                 if p.grad is not None]))) if plain else None
        opt.step()
        opt.zero_grad()
        monitor.step(loss=loss.detach(), grad_norm=grad_norm)
        records.append({"snapshot": monitor.snapshot(), "wq": monitor.wq_spectral_norms(), "signals": monitor.signals(),
                        "grad_norm": true_norm})
        if resume_at == len(records) - 1:
            import torch.distributed as dist

            saved = [monitor.state_dict()]
            dist.broadcast_object_list(saved, src=0)
            monitor.detach()
            monitor = Monitor(monitor.config)
            monitor.load_state_dict(saved[0])
            monitor.attach(model)
    state = monitor.state_dict()
    decisions = {"alerts": [(a.rule, a.step, a.layer, a.head) for a in monitor.alerts],
                 "switches": [(w["step"], w["layer"], w["to"]) for w in monitor.switches], "variants": monitor.variants}
    exact = monitor.wq_spectral_norms(exact=True)
    monitor.detach()
    return {"records": records, "state": state, "exact": exact, "kinds": kinds, "errors": monitor.errors,
            "decisions": decisions}


def run_case(case: str, rank: int | None, resume_at: int | None = None) -> dict:
    """One scenario on this rank (rank None: the unsharded run of the same scenario)."""
    config = MonitorConfig(interval=1, warmup=1, window=2)
    if case == AUTO_FIX:  # every head alerts at step 0: rank 1's heads too, under their global indices
        config = MonitorConfig(interval=1, warmup=1, window=2, max_logit_bound=-1e3, auto_fix="fp32_delta",
                               auto_fix_on={"max_logit"})
    tp = case in ("tp", AUTO_FIX)
    if case.startswith("fsdp1"):
        model = nanogpt(FSDP1_BLOCK_SIZE)
    elif case == "fsdp2_nanogpt":
        model = nanogpt()
    elif case == "fsdp2_hf_gpt2":
        model = HFGPT2()
    else:
        model = LlamaStyleLM(width=64, heads=4) if tp else LlamaStyleLM()
    data = batches(None if (rank is None or tp) else rank)  # tensor-parallel ranks share one batch
    if rank is None:
        return train(model, Monitor(config, process_group=None), data, clip=not tp)
    if case.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, use_orig_params=case == "fsdp1", device_id=torch.device("cpu"))
    elif case.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        blocks = {"fsdp2_nanogpt": lambda: model.transformer.h, "fsdp2_hf_gpt2": lambda: model.lm.transformer.h}.get(
            case, lambda: model.h)()
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2,))
        for block in model.h:
            parallelize_module(block.attn, mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                  "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
    return train(model, Monitor(config), data, clip=not tp, resume_at=resume_at)


def run_mesh_case(rank: int | None, resume_at: int | None = None) -> dict:
    """FSDP2 over tensor parallelism on a 2 x 2 mesh (torchtitan's layout: colwise q/k/v, rowwise
    output, then ``fully_shard`` of each block and the model over the data-parallel dimension):
    each rank holds half of its two heads' query rows; the data-parallel ranks take their own
    batches (rank None: the unsharded run of both batches)."""
    config = MonitorConfig(interval=1, warmup=1, window=2)
    model = LlamaStyleLM(width=64, heads=4)
    if rank is None:
        return train(model, Monitor(config, process_group=None), batches(None), clip=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for block in model.h:
        parallelize_module(block.attn, mesh["tp"], {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                    "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
    for block in model.h:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return train(model, Monitor(config), batches(mesh["dp"].get_local_rank()), clip=False, resume_at=resume_at)


def mesh_worker(rank: int, port: int, out: str) -> None:
    """``run_mesh_case`` on 4 ranks (dp 2 x tp 2), uninterrupted and resumed after step 0."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = {"mesh": run_mesh_case(rank), "resumed": run_mesh_case(rank, resume_at=0)}
        if rank == 0:
            result["unsharded"] = run_mesh_case(None)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


CASES = ("fsdp2_nanogpt", "fsdp2_llama", "fsdp1", "tp") + \
    (("fsdp2_hf_gpt2",) if importlib.util.find_spec("transformers") is not None else ())
UNSUPPORTED = "fsdp1_flat_params"  # FSDP1 with use_orig_params=False: W^Q only inside the flat parameter
AUTO_FIX = "tp_auto_fix"  # tensor parallel with alerts on every head and auto_fix


def worker(rank: int, port: int, out: str, cases: tuple[str, ...]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = {case: run_case(case, rank) for case in cases}
        result["resumed"] = {case: run_case(case, rank, resume_at=0) for case in cases}
        result[UNSUPPORTED] = run_case(UNSUPPORTED, rank)
        result[AUTO_FIX] = run_case(AUTO_FIX, rank)
        if rank == 0:
            result["unsharded"] = {case: run_case(case, None) for case in (*cases, AUTO_FIX)}
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def per_head(snapshot: dict) -> dict[str, dict]:
    """The per-head metrics of a snapshot: ``{name: {(layer, head): value}}``."""
    return {k: v for k, v in snapshot.items()
            if isinstance(v, dict) and v and all(isinstance(key, tuple) and len(key) == 2 for key in v)}


def close(a: float, b: float, rtol: float, atol: float = 0.0) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b))
