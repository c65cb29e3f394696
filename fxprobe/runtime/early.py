"""Selectors that can never match, refused at ``tap()``, before torch dynamo captures anything.

Where part of a model runs under dynamo, its sites are known only once dynamo has captured
them (the first forward, seconds to minutes on a deep model). What the module tree already
decides (``frontends.dynamo_reach``: a glob over module paths, a canonical name the family
cannot have, a module type the model does not hold) is checked here instead, by the rules
``core.select.select`` applies after the capture: a glob that can match nothing is a typo
even in a list; a type (or any other selector) in a list may match nothing as long as some
other one can. What only the capture decides is left to ``Lifecycle.check``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from torch import nn

from ..core.errors import SelectorError
from ..core.names import closest
from ..core.select import Selector
from ..core.site import Site
from ..frontends.dynamo_reach import Reach

_CANONICAL_WORDS = re.compile(r"blocks|resid|attn|mlp|embed|ln_final|logits")


def check_before_capture(root: nn.Module, sites: Sequence[Site], selectors: Sequence[Selector],
                         regions: Sequence[str], *, context: str,
                         other_mode: Callable[[], Sequence[Site]] | None = None) -> None:
    """Raise for a selector that no site of ``root`` can match, dynamo's included.

    Args:
        root: fxprobe's copy of the model.
        sites: the sites known before any forward (fx's and the hooks').
        selectors: what ``ops=`` asked for.
        regions: the paths of the modules dynamo will run.
        context: how the message names the model and mode.
        other_mode: the other mode's known sites, consulted before refusing.

    Raises:
        SelectorError: naming the selector, why it cannot match, and the closest names.
    """
    if not selectors or not regions:
        return
    unmatched = [sel for sel in selectors if not any(sel(s) for s in sites)]
    if not unmatched:
        return
    reach = Reach.of(root, regions)
    verdict = {sel: sel not in unmatched or reach.could_match(sel) for sel in selectors}
    never = [sel for sel in selectors if verdict[sel] is False]
    alone = all(v is False for v in verdict.values())
    refused = [sel for sel in never if sel.strict or len(selectors) == 1 or alone]
    if not refused:
        return
    others = other_mode() if other_mode is not None else ()
    for sel in refused:
        if not any(sel(s) for s in others):
            raise SelectorError(_message(sel, reach, root, sites, context))


def _message(sel: Selector, reach: Reach, root: nn.Module, sites: Sequence[Site],
             context: str) -> str:
    source = sel.source
    head = (f"selector {sel.description} can match no site in {context}, whatever torch "
            "dynamo captures (decided from the module tree, before any capture): ")
    if isinstance(source, type):
        held = sorted({type(m).__name__ for m in root.modules()})
        close = closest(source.__name__, held)
        return (head + f"the model holds no {source.__name__} module"
                + (f". Module types it holds that are close: {', '.join(close)}" if close
                   else f". Module types it holds: {', '.join(held[:12])}"
                   + (" ..." if len(held) > 12 else ""))
                + ". Select a type the model holds, or its calls by path.")
    ex = next((p for p in reach.paths if re.search(r"\.0\.\w+$", p)),
              next((p for p in reach.paths if p), "mlp"))
    why = (f"dynamo names a site by a module path ({ex}, {ex}_1 for its second call), an op "
           f"inside a module ({ex}.add), or a canonical name (blocks.0.resid_post), and no "
           "path of the modules it runs fits the pattern")
    if isinstance(source, str) and _CANONICAL_WORDS.search(source):
        if reach.canonical:
            why += (", nor does any canonical name the model can have ("
                    "blocks.{L}.resid_pre, .attn.q/.k/.v/.scores/.pattern/.z, .attn_out, "
                    ".resid_mid, .mlp.pre/.post, .mlp_out, .resid_post; embed, pos_embed, "
                    "ln_final, logits; L from 0)")
        else:
            why += f"; and {reach.why_no_canonical}"
    close = reach.nearest(sel, (s.name for s in sites))
    hint = f". Did you mean: {', '.join(close)}?" if close else "."
    return (head + why + hint + " Run fxprobe.sites(model, tracer='dynamo', "
            "example_kwargs={...}) to list every site name.")
