"""``MODEL``, ``--input`` and ``--ops`` of the ``fxprobe`` command: the user's text turned into
a model (or a deployed artifact), example tensors and selectors; every mistake a
:class:`~fxprobe.core.errors.UsageError` that says what to type instead."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import math
import os
import re
import sys
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.errors import UsageError
from ..core.names import did_you_mean, one_line
from ..core.select import Selector, as_selector, where
from ..core.site import Site

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
    "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "double": torch.float64, "int64": torch.int64, "long": torch.int64, "int32": torch.int32,
    "int": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_ALIASES = {"nn": "torch.nn", "F": "torch.nn.functional"}
_KINDS = ("module", "function", "fn", "op", "method", "re", "how", "name")


def parse_kw(texts: Sequence[str]) -> dict[str, Any]:
    """``--kw NAME=VALUE`` values -> keyword arguments of the factory, each VALUE a Python
    literal (``64``, ``0.1``, ``True``, ``'gelu'``, ``(2, 2)``); a bare word is a string.

    Raises:
        UsageError: no ``=``, a name that is not an identifier, a name given twice.
    """
    import ast

    out: dict[str, Any] = {}
    for text in texts:
        name, sep, value = text.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise UsageError(f"--kw {text!r}: write NAME=VALUE, for example --kw image_size=64 "
                             "or --kw act='gelu'")
        if name in out:
            raise UsageError(f"--kw {name} is given twice; give each keyword once")
        try:
            out[name] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            if not re.fullmatch(r"[A-Za-z_][\w.-]*", value.strip()):
                raise UsageError(
                    f"--kw {text!r}: {value!r} is not a Python literal; write a number, True, "
                    "None, a quoted string or a tuple (--kw size='(64, 64)')") from None
            out[name] = value.strip()  # a bare word: a string, as a shell user means it
    return out


def load_model(spec: str, kwargs: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Import ``package.module:factory`` or ``path/to/file.py:factory`` and build the model
    (called with ``kwargs``, from ``--kw``), or load a deployed artifact: ``model.pt``
    (TorchScript) or ``model.pt2`` (torch.export).

    Returns:
        The model and the factory's (or file's) name.

    Raises:
        UsageError: a malformed spec, a missing file, module or factory, a factory that raises
        or does not return an ``nn.Module``, an artifact that does not load.
    """
    kwargs = dict(kwargs or {})
    if spec.endswith((".pt", ".pt2")):
        if kwargs:
            raise UsageError(f"--kw is for a factory MODEL; {spec} is a saved model, loaded "
                             "as it was saved")
        return _load_artifact(spec), Path(spec).stem
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", attr):
        raise UsageError(
            f"MODEL {spec!r} is not package.module:factory or path/to/file.py:factory "
            "(for example fxprobe.examples:small_cnn or models.py:make_model)"
        )
    if target.endswith(".py") or "/" in target or os.sep in target:
        module = _import_file(target, spec)
    else:
        module = _import_module(target, spec)
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where_ = target if i == 0 else f"{target}:{'.'.join(attr.split('.')[:i])}"
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise UsageError(
                f"{where_} has no {part!r} (MODEL {spec!r}).{did_you_mean(part, names)}")
        obj = getattr(obj, part)
    if isinstance(obj, nn.Module):
        if kwargs:
            raise UsageError(f"--kw cannot be given: {spec} is a model instance, not a factory")
        return obj, attr
    if not callable(obj):
        raise UsageError(f"{spec} is a {type(obj).__name__}, not a factory; MODEL must name a "
                         "callable that returns the model")
    try:
        model = obj(**kwargs)
    except Exception as e:
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise UsageError(f"calling {spec}({shown}) raised {one_line(e)}; the factory must "
                         "build the model with the keywords given by --kw (none by "
                         "default)") from e
    if not isinstance(model, nn.Module):
        raise UsageError(f"{spec}() returned {type(model).__name__}, not a torch.nn.Module; "
                         "the factory must return the model")
    return model, attr


def _load_artifact(spec: str) -> Any:
    from ..frontends.script import quiet_jit

    if not os.path.isfile(spec):
        raise UsageError(f"no such file: {spec} (MODEL)")
    written_by = ("a .pt MODEL must be written by torch.jit.save, a .pt2 MODEL by "
                  "torch.export.save")
    if not zipfile.is_zipfile(spec):  # what both write; torch would log a traceback first
        raise UsageError(f"cannot load {spec}: it is not a zip archive; {written_by}")
    held: list[logging.LogRecord] = []
    try:
        if spec.endswith(".pt2"):
            with _held_logs("torch.export", held):
                program = torch.export.load(spec)
            for record in held:  # a program that loads: torch's warnings, as torch gives them
                logging.getLogger(record.name).handle(record)
            return program
        with quiet_jit():
            return torch.jit.load(spec)
    except Exception as e:
        # torch.export.load logs its first error with a traceback and raises another one.
        first = next((r.exc_info[1] for r in held if r.exc_info and r.exc_info[1]), e)
        raise UsageError(f"cannot load {spec}: {one_line(first)}; {written_by}") from e


@contextlib.contextmanager
def _held_logs(name: str, held: list[logging.LogRecord]) -> Iterator[None]:
    """Keep the records of logger ``name`` in ``held`` instead of printing them."""
    logger = logging.getLogger(name)

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    logger.addFilter(hold)
    try:
        yield
    finally:
        logger.removeFilter(hold)


def _import_file(target: str, spec: str) -> Any:
    path = Path(target)
    if not path.is_file():
        raise UsageError(f"no such file: {target} (MODEL {spec!r})")
    name = "fxprobe_model_" + re.sub(r"\W", "_", path.stem)
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise UsageError(f"cannot import {target} as Python (MODEL {spec!r})")
    module = importlib.util.module_from_spec(loader_spec)
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so that the file can import its neighbours
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UsageError(f"importing {target} failed: {one_line(e)}") from e
    return module


def _import_module(target: str, spec: str) -> Any:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise UsageError(
                f"no module named {e.name!r} (MODEL {spec!r}); run from the directory that "
                "contains it, or give the file: path/to/file.py:factory"
            ) from e
        raise UsageError(f"importing {target} failed: {one_line(e)}") from e
    except Exception as e:
        raise UsageError(f"importing {target} failed: {one_line(e)}") from e


_MAX_INPUT_BYTES = 8 * 2**30


def parse_inputs(specs: Sequence[str]) -> tuple[torch.Tensor, ...]:
    """``["1x3x224x224", "2x8:int64"]`` -> seeded example tensors (comma-separated works too).

    Raises:
        UsageError: a size that is not a positive integer, or an unknown dtype.
    """
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for text in (t.strip() for s in specs for t in s.split(",")):
        sizes_text, _, dtype_name = text.partition(":")
        dtype = _DTYPES.get(dtype_name or "float32")
        parts = sizes_text.lower().split("x")
        if dtype is None or not all(p.isdigit() and int(p) > 0 for p in parts):
            problem = (f"unknown dtype {dtype_name!r} (use {', '.join(_DTYPES)})"
                       if dtype is None else "sizes must be positive integers joined by 'x'")
            raise UsageError(f"--input {text!r}: {problem}; for example 1x3x224x224 or "
                             "2x128:int64")
        shape = [int(p) for p in parts]
        size = math.prod(shape) * dtype.itemsize
        if size > _MAX_INPUT_BYTES:
            raise UsageError(
                f"--input {text!r} would take {size / 2**30:,.1f} GiB; an example input only "
                "needs the model's real shape at batch 1 (e.g. 1x3x224x224)"
            )
        try:
            if dtype.is_floating_point:
                tensors.append(torch.randn(shape, generator=gen).to(dtype))
            else:
                tensors.append(torch.zeros(shape, dtype=dtype))
        except RuntimeError as e:  # out of memory for an input under the limit
            raise UsageError(f"--input {text!r}: cannot allocate it: {one_line(e)}") from e
    return tuple(tensors)


def example_of(inputs: Sequence[str], tokens: str | None) -> tuple[torch.Tensor, ...] | None:
    """``--tokens BxT`` and ``--input SPEC`` -> the positional example input (token ids
    first), or None when neither was given.

    Raises:
        UsageError: a malformed spec (see :func:`parse_inputs`).
    """
    given = []
    if tokens is not None:
        text = tokens.strip().lower().replace(",", "x")
        parts = text.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise UsageError(f"--tokens {tokens!r}: write BATCHxLENGTH, two positive integers "
                             "(for example --tokens 1x16)")
        given.append(f"{text}:int64")
    given += list(inputs)
    return parse_inputs(given) if given else None


def parse_ops(texts: Sequence[str]) -> list[Selector] | None:
    """``--ops`` values -> selectors (None when none was given). See ``fxprobe sites --help``.

    Raises:
        UsageError: an unknown selector kind, or a name that cannot be found.
    """
    if texts and not any(t.strip() for text in texts for t in text.split(",")):
        raise UsageError("--ops was given but is empty; leave --ops out to list every site, or "
                         "name what to select (e.g. --ops 'layer1.*' or --ops module:Conv2d)")
    parts = [t.strip() for text in texts for t in text.split(",") if t.strip()]
    return [parse_selector(t) for t in parts] if parts else None


def parse_selector(text: str) -> Selector:
    """One ``--ops`` value: a glob, or ``kind:value`` with the kinds of ``--help``."""
    kind, sep, value = text.partition(":")
    if not sep:
        return as_selector(text)
    if kind not in _KINDS or not value:
        raise UsageError(
            f"--ops {text!r}: unknown selector {kind + ':'!r}; use a glob on site names or "
            f"one of {', '.join(k + ':' for k in _KINDS)} followed by a name"
        )
    if kind == "name":
        return as_selector(value)
    if kind == "re":
        try:
            return as_selector(re.compile(value))
        except re.error as e:
            raise UsageError(f"--ops {text!r}: not a regular expression: {e}") from e
    if kind == "how":
        if value not in ("fx", "hook", "dynamo", "script", "export"):
            raise UsageError(f"--ops {text!r}: use how:fx, how:hook, how:dynamo, how:script or "
                             "how:export")
        return where(lambda s: s.how == value, text)
    if kind == "op":
        return where(lambda s: s.op_key == value, text)
    if kind == "method":
        return where(lambda s: s.kind == "call_method" and s.target == value, text)
    if kind == "module":
        cls = _resolve(value)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            sel = as_selector(cls)
            return Selector(sel, text)
        return where(lambda s: _type_named(s, value), text)
    fn = _resolve(value)
    if fn is None or not callable(fn) or isinstance(fn, type):
        raise UsageError(
            f"--ops {text!r}: cannot find a function {value!r}; spell it out as it is "
            "imported (torch.flatten, torch.nn.functional.relu, operator.add), or use "
            f"op:{value.rpartition('.')[2]} to match it by op name"
        )
    return Selector(as_selector(fn), text)


def _resolve(name: str) -> Any:
    """``torch.flatten``, ``nn.Conv2d``, ``F.relu``, ``Conv2d`` (in torch.nn), or None."""
    head, _, rest = name.partition(".")
    head = _ALIASES.get(head, head)
    full = f"{head}.{rest}" if rest else head
    if "." not in full:
        return getattr(torch.nn, full, None) or getattr(torch, full, None)
    module_name, _, attr = full.rpartition(".")
    while module_name:
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception:
            module_name, _, more = module_name.rpartition(".")
            attr = f"{more}.{attr}"
            continue
        for part in attr.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj
    return None


def _type_named(site: Site, name: str) -> bool:
    mtype = site.module_type
    if site.kind == "call_module" and mtype is None and site.type_name:  # .pt/.pt2: no class
        return name in (site.type_name, site.type_name.rpartition(".")[2])
    if site.kind != "call_module" or mtype is None:
        return False
    return any(name in (c.__name__, c.__qualname__, f"{c.__module__}.{c.__qualname__}")
               for c in mtype.__mro__)
