"""Decisions: auto_fix acts on the rules of auto_fix_on only; repeated-max ties are counted at
eps = 0 (an exact tie is a tie: ">=", not ">")."""

from __future__ import annotations

import pytest
import torch

from flashwatch import MonitorConfig
from flashwatch.kernels import AttentionStats, reference
from test_monitor import Run
from test_monitor import _detach_runs, _one_thread  # noqa: F401  (autouse: one thread, runs detached)


@pytest.mark.parametrize("auto_fix_on, switched", [({"delta_drift"}, False), ({"max_logit"}, True)])
def test_auto_fix_switches_only_on_the_rules_of_auto_fix_on(auto_fix_on, switched):
    """Every head raises max_logit at step 0; only when max_logit is in auto_fix_on is a layer switched."""
    run = Run(MonitorConfig(interval=1, warmup=0, max_logit_bound=-1000.0, drift_threshold=1e9,
                            auto_fix="fp32_delta", auto_fix_on=auto_fix_on))
    alerts = run.train(2)
    assert {a.rule for a in alerts} == {"max_logit"}
    if switched:
        assert [s["rule"] for s in run.monitor.switches] == ["max_logit", "max_logit"]
        assert run.monitor.variants == {0: "fp32_delta", 1: "fp32_delta"}
    else:
        assert run.monitor.switches == []
        assert run.monitor.variants == {0: "sdpa", 1: "sdpa"}
        assert all(layer.mode == "observe" for layer in run.monitor.layers)


def _exact_ties(q, k, causal, sm_scale):
    """Rows whose maximum score is reached by two or more keys, exactly (no tolerance), per head (H,)."""
    s = reference.scores(q.double(), k.double(), causal, sm_scale)
    m = s.amax(-1, keepdim=True)
    return ((s == m).sum(-1) >= 2).sum(dim=(0, 2))


def _planted_exact_ties(dtype):
    torch.manual_seed(7)
    B, H, N, D = 1, 2, 24, 16
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.float64) for _ in range(3))
    q[:, :, :, :] = q.abs()  # positive queries ...
    k[:, :, 5] = 3.0  # ... meet two identical large keys: their scores tie exactly at the row max
    k[:, :, 9] = 3.0
    return (t.to(dtype) for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_exact_tie_counts_as_a_repeated_max_at_eps_zero(dtype):
    q, k, v = _planted_exact_ties(dtype)
    stats = AttentionStats(2, "cpu")
    q.requires_grad_(True)
    out = reference.flash_attention(q, k, v, stats=stats, eps=0.0)
    out.sum().backward()
    want = _exact_ties(q.detach(), k, True, 16 ** -0.5)
    assert want.min() >= 10, "the planted ties should be the row max of every row that sees key 9"
    assert stats.repeated_max_rows.tolist() == want.tolist()
    assert (stats.repeated_max_rows_bf16 >= stats.repeated_max_rows).all()  # rounding only merges scores


def test_an_exact_tie_counts_in_the_triton_kernel_at_eps_zero(interpret_dispatch):
    from flashwatch.kernels import flash_attention

    q, k, v = (t.to(torch.bfloat16) for t in _planted_exact_ties(torch.float32))
    stats = AttentionStats(2, "cpu")
    q.requires_grad_(True)
    out = flash_attention(q, k, v, stats=stats, eps=0.0)
    out.float().sum().backward()
    want = _exact_ties(q.detach(), k, True, 16 ** -0.5)
    assert want.min() >= 10
    assert stats.repeated_max_rows.tolist() == want.tolist()


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_an_exact_tie_counts_in_the_observe_mode_statistics_pass_at_eps_zero(path, request):
    from flashwatch.kernels import attention_statistics

    if path == "triton":
        request.getfixturevalue("interpret_dispatch")
    q, k, v = (t.to(torch.bfloat16) for t in _planted_exact_ties(torch.float32))
    out = reference.flash_attention(q, k, v)
    stats = AttentionStats(2, "cpu")
    (attention_statistics if path == "triton" else reference.attention_statistics)(
        q, k, v, out, torch.ones_like(out), stats, eps=0.0)
    want = _exact_ties(q, k, True, 16 ** -0.5)
    assert want.min() >= 10
    assert stats.repeated_max_rows.tolist() == want.tolist()
