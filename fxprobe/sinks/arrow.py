"""Rows of a capture dataset as an Apache Arrow file that Hugging Face ``datasets`` reads.

One column per site, each row a fixed-size list of the row's values (flattened; the shape is
in the metadata), written in the Arrow IPC stream format that ``datasets`` keeps its own files
in: ``datasets.Dataset.from_file(path)`` memory-maps it without a copy. The schema's metadata
holds fxprobe's record: site names, row shapes, dtypes, normalization factors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..core.errors import ConfigError

_ARROW_TYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
                torch.int64: "int64", torch.int32: "int32", torch.int16: "int16",
                torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool_"}


def export_arrow(ds: Any, path: str | os.PathLike[str], batch_size: int = 65536) -> Path:
    """Write every row of ``ds`` (a ``CaptureDataset``), in order, to the Arrow file ``path``.

    Rows are written as read (normalized, if the dataset normalizes: the factors are in the
    metadata under ``fxprobe`` -> ``scale``); bfloat16 rows are written as float32 (Arrow has
    no bfloat16).

    Returns:
        The path written. Read it with ``datasets.Dataset.from_file(str(path))``.

    Raises:
        ConfigError: ``pyarrow`` is missing, or a site's dtype has no Arrow type.
    """
    try:
        import pyarrow as pa
    except ImportError:
        raise ConfigError("exporting to Arrow needs pyarrow: pip install pyarrow") from None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be a positive int")
    names = tuple(ds.names)
    keys = tuple(getattr(ds, "keys", names))  # columns are named as the rows are keyed
    if len(set(keys)) != len(keys):
        raise ConfigError(f"to_arrow: the sites {list(keys)} name a column twice")
    dtypes = {n: torch.float32 if ds.row_dtypes[n] == torch.bfloat16 else ds.row_dtypes[n]
              for n in names}
    for n, dt in dtypes.items():
        if dt not in _ARROW_TYPES:
            raise ConfigError(f"site {n!r} holds {dt} values, which Arrow cannot hold")
    widths = {n: max(1, int(torch.Size(ds.row_shapes[n]).numel())) for n in names}
    pairs = list(zip(keys, names, strict=True))
    fields = [pa.field(k, pa.list_(getattr(pa, _ARROW_TYPES[dtypes[n]])(), widths[n]))
              for k, n in pairs]
    record = {"names": list(keys), "sites": list(names),
              "row_shapes": {k: list(ds.row_shapes[n]) for k, n in pairs},
              "dtypes": {k: str(ds.row_dtypes[n]) for k, n in pairs},
              "scale": dict(ds.scale.factors) if ds.scale is not None else None,
              "rows": len(ds)}
    schema = pa.schema(fields, metadata={"fxprobe": json.dumps(record)})
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for begin in range(0, len(ds), batch_size):
            idx = torch.arange(begin, min(begin + batch_size, len(ds)))
            got = ds._read(idx)
            columns = []
            for n in names:
                flat = got[n].to(dtypes[n]).reshape(len(idx), widths[n]).contiguous()
                values = pa.array(flat.reshape(-1).numpy())
                columns.append(pa.FixedSizeListArray.from_arrays(values, widths[n]))
            writer.write_batch(pa.record_batch(columns, schema=schema))
    os.replace(tmp, out)
    return out
