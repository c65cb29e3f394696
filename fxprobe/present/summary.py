"""Tables of sites: what a tapped module captured, or what a model offers to tap.

``summary()`` turns the :class:`~fxprobe.core.view.View` of a tapped module or artifact (its
selected sites and the values of the last forward) or of a listing of sites into a
:class:`Table` that prints in the terminal, as GitHub Markdown or as HTML. Cells are plain
text, formatted once, so the same table reads the same in every format.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.options import TABLE_FORMATS, table_format
from ..core.record import InOut
from ..core.site import Site
from ..core.view import ValueInfo, View

FORMATS = TABLE_FORMATS
"""fxprobe's ``fmt`` names and the tabulate format each one is (``"html"`` is written here);
a tabulate format name is accepted too (:func:`~fxprobe.core.options.table_format`)."""

_NOT_RUN = "(not run)"
_SHOWN_ITEMS = 4  # elements of a tuple/list/dict value spelled out before "..."


def describe_value(value: Any) -> ValueInfo:
    """Shape, dtype and bytes of ``value`` (a tensor, a nest of them, a record or a scalar)."""
    if _is_stats(value):
        shape = getattr(value, "shape", None)
        dtype = getattr(value, "dtype", None)
        return ValueInfo(_shape_text(shape) if shape is not None else "",
                         _dtype_text(dtype) if dtype is not None else type(value).__name__, None)
    if isinstance(value, InOut):  # shown as its output, what flows on; sized as all it holds
        out, ins = describe_value(value.output), describe_value(value.inputs)
        size = None if out.nbytes is None and ins.nbytes is None else \
            (out.nbytes or 0) + (ins.nbytes or 0)
        return ValueInfo(out.shape, out.dtype, size)
    dtypes: list[str] = []
    total = [0, 0]  # bytes, tensor count

    def shape_of(v: Any, depth: int) -> str:
        if isinstance(v, torch.Tensor):
            d = _dtype_text(v.dtype)
            if d not in dtypes:
                dtypes.append(d)
            total[0] += v.numel() * v.element_size()
            total[1] += 1
            return _shape_text(v.shape)
        if isinstance(v, (tuple, list)) and not isinstance(v, torch.Size):
            parts = [shape_of(x, depth + 1) for x in v]
            shown = parts[:_SHOWN_ITEMS] + (["..."] if len(parts) > _SHOWN_ITEMS else [])
            open_, close = ("(", ")") if isinstance(v, tuple) else ("[", "]")
            return open_ + ", ".join(shown) + ("," if len(parts) == 1 and open_ == "(" else "") \
                + close
        if isinstance(v, Mapping):
            items = [f"{k}: {shape_of(x, depth + 1)}" for k, x in v.items()]
            shown = items[:_SHOWN_ITEMS] + (["..."] if len(items) > _SHOWN_ITEMS else [])
            return "{" + ", ".join(shown) + "}"
        if depth == 0:
            return _scalar_text(v)
        return type(v).__name__

    shape = shape_of(value, 0)
    if total[1]:
        return ValueInfo(shape, ", ".join(dtypes), total[0])
    if isinstance(value, torch.Size):
        return ValueInfo(shape, "Size", None)
    return ValueInfo(shape, type(value).__name__, None)


def _shape_text(shape: Any) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _dtype_text(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _scalar_text(v: Any) -> str:
    if isinstance(v, torch.Size):
        return _shape_text(v)
    if isinstance(v, (bool, int, float, complex, str)) or v is None:
        text = repr(v)
        return text if len(text) <= 24 else ""
    return ""


def _is_stats(value: Any) -> bool:
    # reduce="stats" records, recognised by shape rather than by import so that this module
    # works whichever version of the record is installed.
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)
            and type(value).__name__ == "Stats")


def _stat_cells(value: Any) -> dict[str, str]:
    cells: dict[str, str] = {}
    for f in dataclasses.fields(value):
        if f.name in ("shape", "dtype"):
            continue
        cells[f.name] = _number_text(getattr(value, f.name))
    return cells


def _number_text(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        if v.numel() == 1:
            v = v.item()
        else:
            return f"{_dtype_text(v.dtype)} {_shape_text(v.shape)}"
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def human_bytes(n: int | None) -> str:
    """``512 B``, ``2.0 KiB``, ``1.5 MiB``; empty for None."""
    if n is None:
        return ""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


@dataclass(frozen=True, repr=False)
class Table:
    """A table of sites that prints in the terminal, as Markdown or as HTML.

    ``str(table)`` renders it in ``table.fmt``; ``table.render(fmt)`` in another format. In a
    notebook it shows as HTML.
    """

    headers: tuple[str, ...]
    """Column titles."""
    rows: tuple[tuple[str, ...], ...]
    """One tuple of already formatted cells per row."""
    notes: tuple[str, ...] = ()
    """Lines shown under the table: totals, and modules that run as written (hook fallback)."""
    fmt: str = "text"
    """Format of ``str(table)``: ``"text"``, ``"github"`` (also ``"markdown"``) or ``"html"``
    (or a tabulate format name)."""
    numeric: frozenset[str] = frozenset()
    """Headers of the columns aligned to the right."""

    def render(self, fmt: str | None = None) -> str:
        """The table as text in ``fmt`` (default: ``self.fmt``)."""
        tablefmt = table_format(self.fmt if fmt is None else fmt)
        if tablefmt == "html":
            return self._html()
        try:
            from tabulate import tabulate
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise ImportError("fxprobe tables need tabulate: pip install tabulate") from e
        align = tuple("right" if h in self.numeric else "left" for h in self.headers)
        body = tabulate([list(r) for r in self.rows], headers=list(self.headers),
                        tablefmt=tablefmt, disable_numparse=True, colalign=align)
        bullet = "- " if tablefmt in ("github", "pipe") else ""
        return body + "\n\n" + "\n".join(bullet + n for n in self.notes) if self.notes else body

    def _html(self) -> str:
        # tabulate pads HTML cells with spaces; written by hand, cells are exactly the text.
        def row(tag: str, cells: Sequence[str]) -> str:
            return "<tr>" + "".join(
                f'<{tag}{self._align(h)}>{html.escape(c)}</{tag}>'
                for h, c in zip(self.headers, cells, strict=True)) + "</tr>"

        lines = ["<table>", "<thead>", row("th", self.headers), "</thead>", "<tbody>"]
        lines += [row("td", r) for r in self.rows]
        lines += ["</tbody>", "</table>"]
        lines += [f"<p>{html.escape(n)}</p>" for n in self.notes]
        return "\n".join(lines)

    def _align(self, header: str) -> str:
        return ' style="text-align: right;"' if header in self.numeric else ""

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        return self.render()

    def _repr_html_(self) -> str:
        return self.render("html")

    def column(self, header: str) -> list[str]:
        """The cells of one column, top to bottom."""
        i = self.headers.index(header)
        return [r[i] for r in self.rows]


def check_format(fmt: str) -> str:
    """``fmt`` once :func:`~fxprobe.core.options.table_format` accepts it."""
    table_format(fmt)
    return fmt


def tapped_table(sites: Sequence[Site], taps: Mapping[str, Any], fallbacks: Iterable[Any],
                 fmt: str = "text") -> Table:
    """The selected sites with what the last forward captured at each."""
    check_format(fmt)
    selected = {s.name for s in sites}
    extra: dict[str, list[str]] = {}  # repeated hook calls: "fc_1" goes under "fc"
    for key in taps:
        base, _, n = key.rpartition("_")
        if key not in selected and base in selected and n.isdigit():
            extra.setdefault(base, []).append(key)
    records: list[tuple[Site, str, Any]] = []
    for s in sites:
        records.append((s, s.name, taps[s.name] if s.name in taps else _NOT_RUN))
        for key in extra.get(s.name, []):
            records.append((s, key, taps[key]))
    stat_names: list[str] = []
    for _, _, value in records:
        if _is_stats(value):
            stat_names += [k for k in _stat_cells(value) if k not in stat_names]
    headers = ("name", "op", "how", "shape", "dtype", "bytes", *stat_names)
    rows = []
    total: int | None = None
    for site, key, value in records:
        if value is _NOT_RUN:
            rows.append((key, site.op, site.how, _NOT_RUN, "", "", *([""] * len(stat_names))))
            continue
        info = describe_value(value)
        if info.nbytes is not None:
            total = (total or 0) + info.nbytes
        stats = _stat_cells(value) if _is_stats(value) else {}
        rows.append((key, site.op, site.how, info.shape, info.dtype, human_bytes(info.nbytes),
                     *(stats.get(k, "") for k in stat_names)))
    hooks = sum(1 for s in sites if s.how == "hook")
    dyn = sum(1 for s in sites if s.how == "dynamo")
    ran = sum(1 for _, _, v in records if v is not _NOT_RUN)
    size = f", {human_bytes(total)} in all" if total is not None else ""
    notes = [f"{len(sites)} sites tapped ({len(sites) - hooks - dyn} fx, {hooks} hook"
             f"{f', {dyn} dynamo' if dyn else ''}); "
             f"{ran} values captured in the last forward{size}"]
    notes += _fallback_notes(fallbacks)
    return Table(headers, tuple(rows), tuple(notes), fmt,
                 frozenset({"bytes", *stat_names}))


def sites_table(sites: Sequence[Site], fallbacks: Iterable[Any], fmt: str = "text",
                tapped: Iterable[str] | None = None) -> Table:
    """Every site: name, op, module path, and whether fx or only a hook reaches it; with a
    ``canonical`` column after the name where any site has canonical names (a transformer's
    ``blocks.0.resid_post``, which select it as its name does)."""
    check_format(fmt)
    chosen = set(tapped) if tapped is not None else None
    canonical = any(s.canonical for s in sites)  # a transformer's: its vocabulary's names
    headers = ("name",) + (("canonical",) if canonical else ()) + (
        "op", "module path", "how") + (("tapped",) if chosen is not None else ())
    rows = []
    for s in sites:
        row: tuple[str, ...] = (s.name,) + ((", ".join(s.canonical),) if canonical else ()) + (
            s.op, s.module_path, s.how)
        if chosen is not None:
            row += ("yes" if s.name in chosen else "",)
        rows.append(row)
    notes = [_how_note(sites)]
    notes += _fallback_notes(fallbacks)
    return Table(headers, tuple(rows), tuple(notes), fmt)


_OP_LEVEL = {"fx": "fx", "dynamo": "torch dynamo", "script": "TorchScript graph",
             "export": "torch.export graph"}


def _how_note(sites: Sequence[Site]) -> str:
    """``38 sites: 38 at op level (TorchScript graph)``: the count by how each is reached."""
    counts: dict[str, int] = {}
    for s in sites:
        counts[s.how] = counts.get(s.how, 0) + 1
    if set(counts) <= {"fx", "hook", "dynamo"}:  # a model: say what only hooks reach
        parts = [f"{counts.get('fx', 0)} at op level (fx)"]
        if counts.get("dynamo"):
            parts.append(f"{counts['dynamo']} at op level (torch dynamo)")
        parts.append(f"{counts.get('hook', 0)} by module hook only (inside code torch.fx "
                     "could not trace)")
    else:  # an artifact: every site is a value of its graph
        parts = [f"{n} at op level ({_OP_LEVEL.get(how, how)})" for how, n in counts.items()]
    return f"{len(sites)} site{'' if len(sites) == 1 else 's'}: " + ", ".join(parts)


def _fallback_notes(fallbacks: Iterable[Any]) -> list[str]:
    notes = []
    for f in fallbacks:
        loc = f" at {f.location}" if f.location else ""
        notes.append(f"runs as written (hook fallback): {f.where} ({f.module_type.__name__}): "
                     f"{f.error}{loc}")
    return notes


def summary(view: View, fmt: str = "text") -> Table:
    """The table of what ``view`` shows: a tapped object's selected sites with what its last
    forward captured (and what torch dynamo captured, under it), or a listing of sites.

    ``fxprobe.summary`` (``fxprobe.runtime.views``) hands this the view of what it is given.

    Raises:
        ConfigError: ``fmt`` is not one of :data:`FORMATS` nor a tabulate format.
    """
    check_format(fmt)
    if not view.tapped:
        return sites_table(view.sites, view.fallbacks, fmt)
    table = tapped_table(view.selected, view.taps or {}, view.fallbacks, fmt)
    captured = tuple(str(info) for info in view.dynamo_info)  # graphs and breaks (dynamo)
    return dataclasses.replace(table, notes=table.notes + captured) if captured else table
