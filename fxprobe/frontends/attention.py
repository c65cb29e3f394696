"""Attention beside SDPA: the probabilities (and, with ``fn=``, the edited pattern or scores
driving the attention output) that the dynamo frontend computes next to every
``F.scaled_dot_product_attention`` call it captured, since SDPA never shows them."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from ..capture.inplace import OUT_OF_PLACE
from ..core.errors import InterventionError
from ..core.site import CALL_ARGS, KERNEL, SITES, Site


def attention_probs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None = None,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                    is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False) -> torch.Tensor:
    """The attention probabilities inside ``F.scaled_dot_product_attention(query, key, ...)``.

    ``softmax(query @ key.T * scale + mask)`` as the math path of SDPA computes it, before
    dropout; a query that may attend to no key (a fully masked row) gets zeros, as in SDPA.

    As a selector (``ops=fxprobe.attention_probs``) it taps these probabilities beside every
    SDPA call that the dynamo frontend captured: computed on the side from the call's own
    arguments, only for the selected calls, while the model keeps its fused attention. Each
    such site is named ``<module path>.attention_probs``. A pattern that ``fn=`` replaces
    drives the attention output (``pattern @ value``, see ``_attend``).

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa: as for
            ``F.scaled_dot_product_attention`` (``value`` and ``dropout_p`` are not used).

    Returns:
        A tensor shaped ``(..., heads, query length, key length)``.

    Example:
        >>> tapped = fxprobe.tap(model, ops=fxprobe.attention_probs, tracer="dynamo")
        >>> out = tapped(input_ids=ids)
        >>> tapped.taps["transformer.h.0.attn.attention_probs"].shape  # (batch, heads, q, k)
    """
    scores = attention_scores(query, key, attn_mask=attn_mask, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    return _safe_softmax(scores)


def attention_scores(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None = None,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    """The attention scores inside ``F.scaled_dot_product_attention(query, key, ...)``.

    ``query @ key.T * scale + mask`` as the math path of SDPA computes it, before the softmax;
    positions the mask excludes are ``-inf`` (a boolean mask, ``is_causal``) or carry the
    float mask's value. Beside every SDPA call the dynamo frontend captured, a site
    ``<module path>.attention_scores`` holds them (computed only where selected); its
    canonical name is ``blocks.{L}.attn.scores``.

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa: as for
            ``F.scaled_dot_product_attention`` (``value`` and ``dropout_p`` are not used).

    Returns:
        A tensor shaped ``(..., heads, query length, key length)``.
    """
    q_len, k_len = query.size(-2), key.size(-2)
    if scale is None:
        scale = 1.0 / math.sqrt(query.size(-1))
    if enable_gqa and key.dim() >= 3 and key.size(-3) != query.size(-3):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), dim=-3)
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(causal.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    return scores


def _safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """``softmax(scores)`` as SDPA's math path (a "safe" softmax) gives it: rows that attend
    to nothing are zeros, not NaN."""
    probs = torch.softmax(scores, dim=-1)
    return probs.masked_fill(scores.isneginf().all(dim=-1, keepdim=True), 0.0)


def _weigh(pattern: torch.Tensor, value: torch.Tensor, dropout_p: float,
           enable_gqa: bool) -> torch.Tensor:
    """``pattern @ value`` after SDPA's dropout, grouped-query heads repeated."""
    if dropout_p > 0.0:
        pattern = torch.nn.functional.dropout(pattern, dropout_p)
    if enable_gqa and value.dim() >= 3 and value.size(-3) != pattern.size(-3):
        value = value.repeat_interleave(pattern.size(-3) // value.size(-3), dim=-3)
    return torch.matmul(pattern.to(value.dtype), value)


@functools.cache
def _twice(fn: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """A function (a graph's call target) returning ``fn(*args)`` (the pattern or the scores
    beside SDPA) for the site, which ``fn=`` may replace or edit in place, and the same tensor
    with its version, which tell :func:`_attend` and :func:`_attend_scores` whether it did."""

    def twice(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, int]]:
        value = fn(*args, **kwargs)
        return value, (value, value._version)

    twice.__name__ = twice.__qualname__ = f"_twice_{fn.__name__}"
    return twice


def _attend(out: torch.Tensor, pattern: torch.Tensor, made: tuple[torch.Tensor, int],
            query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
            is_causal: bool = False, scale: float | None = None,
            enable_gqa: bool = False) -> torch.Tensor:
    """The attention output: SDPA's own ``out`` while the pattern is the one it computed, else
    ``pattern @ value`` (after SDPA's dropout), so that an edited pattern drives the output."""
    if pattern is made[0] and pattern._version == made[1]:
        return out
    return _weigh(pattern, value, dropout_p, enable_gqa)


def _attend_scores(out: torch.Tensor, raw: torch.Tensor, scores: torch.Tensor,
                   made: tuple[torch.Tensor, int], query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                   dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """The attention output after the scores' site: ``out`` while the scores are the ones
    computed, else ``softmax(scores) @ value`` (after SDPA's dropout), as the eager math path
    computes it from the edited scores. ``raw`` is SDPA's own output: an edited pattern too
    (``out`` is not ``raw``) is refused, since one of the two edits would be lost."""
    if scores is made[0] and scores._version == made[1]:
        return out
    if out is not raw:
        raise InterventionError(
            "fn= edited both the attention scores and the attention pattern of one SDPA "
            "call; only one of them can drive its output: edit one, or use "
            "attn_implementation='eager'")
    return _weigh(_safe_softmax(scores.float()).to(value.dtype), value, dropout_p, enable_gqa)


# Returns its first argument or new memory, and writes nothing (for the in-place analysis).
setattr(_attend, OUT_OF_PLACE, True)
setattr(_attend_scores, OUT_OF_PLACE, True)


def beside(graph: fx.Graph, sdpa: fx.Node, probs: Site) -> fx.Node:
    """The pattern (or the scores, ``probs.target``) beside the SDPA call ``sdpa``, computed
    from its arguments: what the kernel computes, so it reads what an edit gives the kernel
    (``core.site.KERNEL``: an edited ``attn.k``, not the keys the cache keeps)."""
    with graph.inserting_after(sdpa):
        node = graph.call_function(probs.target, sdpa.args, dict(sdpa.kwargs))
    node.meta[KERNEL] = True
    return node


def drive_output(graph: fx.Graph, sdpa: fx.Node, probs: Site) -> fx.Node:
    """With ``fn=``: insert the pattern (or the scores) beside the SDPA call so that the code
    after the call reads :func:`_attend`'s (:func:`_attend_scores`') output, which follows an
    edited pattern (scores); return the pattern's (scores') node.

    ::

        before:  q, k, v -> sdpa -> next
        after:   q, k, v -> sdpa -----------------------> attend -> next
                         -> _twice -> getitem(0) -> (the site: fn, keep)
                                         -> getitem(1) -> attend

    The call's sites (its own, a module call ending there) move to ``attend``: their value is
    the attention output that flows on. The pattern's site (``site``) reads the call's
    arguments, as beside SDPA without ``fn=``.
    """
    site = probs.name
    scores = probs.target is not attention_probs  # the scores beside SDPA (canonical)
    # Beside a call another site already rewired, the output that flows on is its user.
    flowing = next((u for u in sdpa.users if u.target in (_attend, _attend_scores)), sdpa)
    with graph.inserting_after(sdpa):
        pair = graph.call_function(_twice(probs.target), sdpa.args, dict(sdpa.kwargs))
    pair.meta[KERNEL] = True  # what the kernel computes: from the keys an edit gives it
    with graph.inserting_after(pair):
        pattern = graph.call_function(operator.getitem, (pair, 0))
    pattern.meta[CALL_ARGS] = {site: (tuple(sdpa.args), pair)}
    with graph.inserting_after(pattern):
        made = graph.call_function(operator.getitem, (pair, 1))
    anchor = flowing if flowing is not sdpa else made
    with graph.inserting_after(anchor):
        if scores:
            out = graph.call_function(_attend_scores, (flowing, sdpa, pattern, made, *sdpa.args),
                                      dict(sdpa.kwargs))
        else:
            out = graph.call_function(_attend, (flowing, pattern, made, *sdpa.args),
                                      dict(sdpa.kwargs))
    out.meta[KERNEL] = True  # what the kernel computes, from the values an edit gives it
    flowing.replace_all_uses_with(
        out, delete_user_cb=lambda user: user is not out and user.target not in (
            _attend, _attend_scores))
    # The call's sites (its own, a module call ending there) move to what flows on; their
    # inputs stay the call's: the SDPA op's arguments, a module call's as named.
    sites = flowing.meta.pop(SITES, [])
    if sites:
        calls = flowing.meta.pop(CALL_ARGS, {})
        out.meta[SITES] = sites
        out.meta[CALL_ARGS] = {s.name: calls.get(s.name, (tuple(sdpa.args), sdpa))
                               for s in sites}
    for key in ("nn_module_stack", "stack_trace"):
        if key in sdpa.meta:
            out.meta[key] = sdpa.meta[key]
    return pattern
