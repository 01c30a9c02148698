"""The kernels' configuration tables keep the block-shape constraints their loops rely on."""

import pytest
import torch

from flashwatch.kernels import tuning

# causal loops take whole key blocks below a query block
ROWS_OVER_KEYS = ("fwd", "fwd_fixed", "fwd_hopper", "fwd_hopper_ws", "dq", "dq_stats", "dq_rows", "stats",
                  "stats_rows")


@pytest.mark.parametrize("kind", sorted(tuning.TABLE))
def test_every_configuration_keeps_its_kernels_block_constraint(kind):
    configs = list(tuning.TABLE[kind].values()) + tuning.CANDIDATES[kind] + [tuning.INTERPRETER[kind]]
    for cfg in configs:
        if kind in ROWS_OVER_KEYS:
            assert cfg["BLOCK_M"] % cfg["BLOCK_N"] == 0, (kind, cfg)
        else:
            assert cfg["BLOCK_N"] % cfg["BLOCK_M"] == 0, (kind, cfg)
        assert set(cfg) <= {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "maxnreg"}, cfg


def test_own_compilations_have_their_own_entry_for_every_head_dim():
    assert set(tuning.TABLE["dq_stats"]) == set(tuning.TABLE["dq"])
    assert set(tuning.TABLE["dq_rows"]) == set(tuning.TABLE["dq"])
    assert set(tuning.TABLE["fwd_fixed"]) == set(tuning.TABLE["fwd"])
    assert any("maxnreg" in cfg for cfg in tuning.CANDIDATES["dq_stats"])


def test_override_wins_and_clears():
    q = torch.zeros(1, 1, 8, 64)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    tuning.set_override("dq_stats", cfg)
    try:
        assert tuning.choose("dq_stats", q, True, None) == cfg
    finally:
        tuning.set_override("dq_stats", None)
    assert tuning.choose("dq_stats", q, True, None) == tuning.INTERPRETER["dq_stats"]
