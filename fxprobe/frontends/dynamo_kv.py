"""The key/value cache a transformers model makes for itself, made before dynamo traces it.

A transformers decoder called with ``use_cache`` and no cache makes one at the top of its
forward::

    if use_cache and cache is None:
        cache = DynamicCache(config=self.config)

Traced by dynamo, that constructor reads the config once per layer through
``PreTrainedConfig.__getattribute__`` (its per-layer view): about 17 ms a layer on a 2-core
CPU, 1.3 s of an 80-layer model's first call (``benchmarks/scale.py``), in every capture of a
call without a cache. A :class:`~.dynamo.DynamoRegion` makes that same cache itself, eagerly,
and passes it as the call's cache (:meth:`MadeCache.call`): the model's forward then finds one
and makes none. What the call computes and returns is unchanged (the cache the output holds is
the one the model would have made, filled the same way).

Only where the model's code says it would make exactly this cache (:func:`made_cache`): the
region's forward takes the cache by a keyword, and the forward that makes it (the region's
own, or that of a direct submodule the region's forward hands its cache to, as a
``...ForCausalLM`` hands it to its ``model``, with its ``use_cache`` as it came: by name or in
``**kwargs``, never set nor replaced by another flag) holds the two lines above as written. Anything
else (GPT-2's forward, which may wrap its cache; an encoder-decoder's; a model of one's own)
is left to make its cache as it does. Per call, only where the call gives no cache, the
model and the making module are in eval mode, ``use_cache`` (the argument, else the making module's
``config.use_cache``) is true, and no outer ``torch.compile`` traces the call.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_MAKES = re.compile(r"\n([ \t]+)if use_cache and (cache|past_key_values) is None:[ \t]*\n"
                    r"\1[ \t]+\2 = DynamicCache\(config=self\.config\)[ \t]*\n")
"""The lines by which a transformers forward makes its own cache, the keyword captured."""


def _source(fn: Any) -> str:
    try:
        return inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError, ValueError):
        return ""


_USE_CACHE = re.compile(r"\buse_cache\s*=(?!=)(?!\s*use_cache\b)")
"""``use_cache`` set, or handed on, as anything but itself (``use_cache = False`` given labels,
``use_cache=use_streaming``)."""


def _hands_on(source: str, keyword: str) -> bool:
    """Whether a forward hands its cache, and its ``use_cache`` (by name or in ``**kwargs``),
    on as they came: only then is the call's ``use_cache`` the one its decoder sees."""
    return (re.search(rf"\b{keyword}={keyword}\b", source) is not None
            and _USE_CACHE.search(source.split('"""')[-1]) is None)


class MadeCache:
    """How one region's calls get the cache their model would make (see the module
    docstring)."""

    def __init__(self, module: nn.Module, maker: nn.Module, keyword: str,
                 signature: inspect.Signature, cache_type: type) -> None:
        self.module = module
        self.maker = maker
        self.keyword = keyword
        self.signature = signature
        self.cache_type = cache_type

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments with the cache the model would make, where it would make it:
        in the slot the call gave ``None`` in (by position or keyword), else by keyword."""
        if self.module.training or self.maker.training or torch.compiler.is_compiling() or (
                "past_key_values" in kwargs and self.keyword != "past_key_values"):
            return args, kwargs  # (transformers maps the deprecated keyword onto the cache)
        try:
            bound = self.signature.bind_partial(self.module, *args, **kwargs).arguments
        except TypeError:  # the model's own call raises it
            return args, kwargs
        if bound.get(self.keyword) is not None:  # given (None: the model makes one)
            return args, kwargs
        use = bound.get("use_cache", kwargs.get("use_cache"))  # a parameter, or **kwargs
        if use is None:  # as transformers' merge_with_config_defaults resolves it
            use = getattr(self.maker.config, "use_cache", None)
        if use is not True:
            return args, kwargs
        made = self.cache_type(config=self.maker.config)
        at = list(self.signature.parameters).index(self.keyword) - 1  # after ``self``
        if at < len(args):  # given as None by position
            return (*args[:at], made, *args[at + 1:]), kwargs
        return args, {**kwargs, self.keyword: made}


def made_cache(module: nn.Module, forward: Callable[..., Any]) -> MadeCache | None:
    """How the region's calls (``forward``, the forward the region runs) get their model's
    own cache made before the capture; None where the model's code does not say it makes a
    ``DynamicCache(config=self.config)`` of its own (see the module docstring)."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        from transformers.cache_utils import DynamicCache
        signature = inspect.signature(forward)
    except (ImportError, TypeError, ValueError):
        return None
    for maker in (module, *module.children()):
        found = _MAKES.search(_source(type(maker).forward))
        if found is None or getattr(maker, "config", None) is None:
            continue
        keyword = found.group(2)
        if keyword not in signature.parameters:
            return None
        if maker is not module and not _hands_on(_source(forward), keyword):
            return None
        return MadeCache(module, maker, keyword, signature, DynamicCache)
    return None
