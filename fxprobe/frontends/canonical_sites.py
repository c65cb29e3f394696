"""From the roles found in a graph to its sites (``frontends/canonical.py``): which site each
canonical name goes on (one name, one site), the keys and values an attention kernel reads
(``core.site.KERNEL_KV``), and a site for keys and values the graph is given (a decoder
step's cached cross-attention keys, a graph input that no site named)."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

from torch import fx

from ..core.site import KERNEL_KV, Site, attach, node_site, source_name
from .canonical_data import after_writes, reduced
from .canonical_graph import GraphIndex
from .dynamo_names import NamedGraph, StableNamer


class RoleNames:
    """Collects the canonical names of nodes."""

    def __init__(self) -> None:
        self.names: dict[fx.Node, list[str]] = {}

    def put(self, node: fx.Node | None, name: str) -> None:
        if node is not None:
            names = self.names.setdefault(node, [])
            if name not in names:
                names.append(name)


def give(graph: fx.Graph, g: GraphIndex, named: NamedGraph, scores: dict[fx.Node, Site],
         out: RoleNames, fused: set[fx.Node], namer: StableNamer | None, repeat: int
         ) -> NamedGraph:
    """``named`` with each canonical name of ``out`` on the site it names, and the
    ``attention_scores`` sites ``scores`` beside the SDPA calls ``fused``.

    Keys or values a kernel reads straight from a graph input (a decoder step's cross-attention
    reads the encoder's keys from the cache) get a site of their own, named by ``namer`` after
    the module whose kernel reads them and the input's last attribute (``...EncDecAttention.keys``);
    without ``namer`` (a graph torch.fx traced) they get no name."""
    replaced: dict[int, Site] = {}
    # A canonical name that is another site's own name (a q projection at the path
    # ``blocks.0.attn.q``) stays that site's alone: one name, one site to read and to edit.
    own = {s.name for s in named.order} | {s.name for s in named.sites.values()}
    chosen: dict[tuple[int, str], Site] = {}
    kv: dict[tuple[int, str], fx.Node] = {}
    inputs: dict[fx.Node, Site] = {}
    for node, names in out.names.items():
        # What the code after it reads: the value after the in-place writes that follow it
        # (a row-parallel projection's partial sum, reduced in place into the same tensor).
        written = reduced(g, node)
        for n in names:
            # Beside SDPA, the scores and the pattern are the sites computed from its arguments.
            target = node_site(written) or node_site(node)
            if n.endswith(".scores") and node in scores:
                target = scores[node]
            elif n.endswith(".pattern") and node in named.sdpa:
                target = named.sdpa[node]
            elif n.endswith((".scores", ".pattern")) and node in fused:
                continue  # an SDPA call with no such site beside it: its value is no pattern
            read = written if node_site(written) else node
            if n.endswith((".k", ".v")) and read is not (read := after_writes(g, read)):
                target = node_site(read)  # a static cache's buffer, this step written into it
            if target is None and n.endswith((".k", ".v")) and namer is not None \
                    and g.given(read) and read.op == "placeholder":
                target = inputs.get(read) or inputs.setdefault(
                    read, _input_site(g, read, namer, repeat, own))
            if target is not None and (n not in own or n == target.name):
                chosen[(id(target), n)] = target
                if n.endswith((".k", ".v")):  # what the kernel reads, and the KV cache
                    kv[(id(target), n)] = read
    # One name, one value: a name found on two sites (roles confused) is neither's.
    sites_of_name = Counter(n for _, n in chosen)
    for (key, n), target in chosen.items():
        cur = replaced.get(key, target)
        if sites_of_name[n] == 1 and n not in cur.canonical:
            replaced[key] = dataclasses.replace(cur, canonical=(*cur.canonical, n))
            if (key, n) in kv:
                kv[(key, n)].meta[KERNEL_KV] = True
    named_inputs = {node: s for node, s in inputs.items() if id(s) in replaced}
    if not replaced and not scores:
        return named
    for node, site in named_inputs.items():
        attach(node, site)
    # The inputs first, in graph order (the forward's own, then those named here); the scores
    # right before the probabilities.
    order = [s for s in named.order if s.kind == "placeholder"] + list(named_inputs.values())
    probs_ids = {id(s): n for n, s in named.sdpa.items()}
    for s in named.order:
        if s.kind == "placeholder":
            continue
        if id(s) in probs_ids:
            order.append(scores[probs_ids[id(s)]])
        order.append(s)
    return dataclasses.replace(named, sites={**named.sites, **named_inputs}, order=order,
                               scores=scores).with_sites(replaced, graph)


def _input_site(g: GraphIndex, node: fx.Node, namer: StableNamer, repeat: int,
                own: set[str]) -> Site:
    """A site for the graph input ``node`` that an attention kernel reads as its keys or
    values, named after the module whose code reads it."""
    readers = [u for u in node.users if g.path(u)]
    path = min((g.path(u) or "" for u in readers), key=len, default="")
    source = source_name(node) or node.name
    leaf = next((w for w in reversed(re.findall(r"[A-Za-z_]\w*", source))
                 if w not in ("L", "kwargs", "args")), "input")
    base = f"{path}.{leaf}" if path else leaf
    location = f"input {source}#{repeat}" if repeat else f"input {source}"
    name = namer.name(base, location, 0)
    while name in own:  # never another site's own name (the namer knows only its own)
        name = namer.name(base, location + "'", 0)
        location += "'"
    own.add(name)
    return Site(name, "dynamo", "placeholder", source, path, None, None)


__all__ = ["RoleNames", "give"]
