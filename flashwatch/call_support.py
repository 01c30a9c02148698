"""What flashwatch can measure of one ``torch.nn.functional.scaled_dot_product_attention`` call.

``unsupported_reason``: why flashwatch's own kernel cannot run the call (own-kernel mode then
runs torch SDPA); it takes attention masks (``flash_attention``'s ``attn_mask``).
``statistics_route``: how the statistics measure a call beside the model's own SDPA: the plain
pass (``flashwatch.kernels.attention_statistics``, Triton on CUDA), the dense pass for masks and
unequal lengths (``flashwatch.kernels.masked``), scores only (attention dropout: the delta error
is not measured), or not at all. Python checks only: shapes, dtypes and arguments, never tensor
values.
"""

from __future__ import annotations

import torch

__all__ = ["unsupported_reason", "statistics_route", "MEASURED"]


def unsupported_reason(q, k, v, attn_mask, dropout_p, enable_gqa, num_heads: int, is_causal: bool = False
                       ) -> str | None:
    """Why flashwatch's kernel cannot take this SDPA call (None if it can). Python checks only."""
    from flashwatch.kernels import DTYPES, HEAD_DIMS
    from flashwatch.kernels.checks import check_attn_mask

    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query, key and value are not all tensors"
    if attn_mask is not None:
        if is_causal:  # SDPA refuses the call: it runs, and says so
            return "an attn_mask is given with is_causal=True"
        reason = unsupported_reason(q, k, v, None, dropout_p, enable_gqa, num_heads)
        if reason is not None:
            return reason
        try:
            check_attn_mask(attn_mask, q)
        except (TypeError, ValueError) as exc:
            return f"the attn_mask is not one the kernel takes ({exc})"
        return None
    if dropout_p:
        return f"attention dropout is on (dropout_p={dropout_p})"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"inputs are not (B, heads, N, D) (q has shape {tuple(q.shape)})"
    if k.shape != v.shape or k.shape[0] != q.shape[0]:
        return f"key/value shapes {tuple(k.shape)}, {tuple(v.shape)} do not match the query {tuple(q.shape)}"
    if q.shape[2] != k.shape[2]:
        return f"query and key lengths differ ({q.shape[2]} vs {k.shape[2]}: a KV cache or cross attention)"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} is not one of {HEAD_DIMS}"
    if q.shape[1] != k.shape[1] and (not enable_gqa or q.shape[1] % k.shape[1]):
        return f"{q.shape[1]} query heads and {k.shape[1]} key heads without enable_gqa"
    if q.shape[1] != num_heads:
        return f"the call has {q.shape[1]} query heads, the layer was attached with {num_heads}"
    if q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (accepted: one of {DTYPES})"
    return None


def statistics_route(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, num_heads: int
                     ) -> tuple[str | None, str | None]:
    """How the statistics can measure this SDPA call: (route, reason). Python checks only.

    Routes: ``"plain"`` (``flashwatch.kernels.attention_statistics``: the Triton pass on CUDA),
    ``"masked"`` (an attn_mask, or query and key lengths that differ without ``is_causal``:
    ``flashwatch.kernels.masked``, dense, padding rows left out), ``"scores"`` (attention dropout:
    rows, repeated maxima and max logit measured by the plain pass, the delta error not),
    ``"masked_scores"`` (attention dropout with a mask or unequal lengths: the same, by the dense
    pass) and None (not measured). ``reason`` says what the call has that the plain pass does not
    take (None for ``"plain"``).
    """
    from flashwatch.kernels import DTYPES
    from flashwatch.kernels.masked import mask_reason

    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None, "query, key and value are not all tensors"
    reason = unsupported_reason(q, k, v, attn_mask, dropout_p, enable_gqa, num_heads, bool(is_causal))
    if reason is None and attn_mask is None:
        return "plain", None
    if reason is None:  # the own kernel takes it; the plain statistics pass takes no mask
        reason = "an attn_mask is given (padding or a custom mask)"
    if dropout_p:
        # dropout acts on the probabilities after the softmax: the scores, and so the rows, their
        # repeated maxima and the max logit, are those of the same call without it
        route, why = statistics_route(q, k, v, attn_mask, 0.0, is_causal, enable_gqa, num_heads)
        dropout = f"attention dropout is on (dropout_p={dropout_p})"
        if route == "plain":
            return "scores", dropout
        if route == "masked":
            return "masked_scores", f"{dropout} and {why}"
        return None, f"{dropout} and {why}"
    if attn_mask is None and q.dim() == 4 and k.dim() == 4 and q.shape[2] == k.shape[2]:
        return None, reason  # not a mask or a length the dense pass could take
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] \
            or k.shape[-1] != q.shape[-1]:
        return None, reason
    if q.shape[1] != num_heads or (q.shape[1] != k.shape[1] and (not enable_gqa or q.shape[1] % k.shape[1])):
        return None, reason
    if q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype):
        return None, reason
    why = mask_reason(attn_mask, q, k, bool(is_causal))
    return ("masked", reason) if why is None else (None, why)


MEASURED = {  # what the log says of the calls of each route
    None: "those calls are not measured",
    "scores": "their repeated maxima and max logit are measured, their delta error is not",
    "masked_scores": "their repeated maxima and max logit are measured by the masked statistics pass (padding rows "
                     "left out; the plain pass where the mask is only the causal pattern); their delta error is not",
    "masked": "they are measured by the masked statistics pass (padding rows left out; the plain pass where the mask "
              "is only the causal pattern)",
}
