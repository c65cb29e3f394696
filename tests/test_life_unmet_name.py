"""A block naming a site inside a module that torch dynamo stopped capturing past its recompile
limit, which no site met, on "twice-auto" (``Inner``, run by dynamo as a frame of its own,
called twice per forward) under a limit of 2.

The forward is refused (run as written, the module would go unedited), and the refusal said
"which only dynamo's graphs reached" also for a misspelt name (``inner.relu_9``) that no graph
had: where dynamo ran a whole call of the module, such a name gets the "matches no site ...
Closest site names" error of a misspelt selector (leaving the block too, also when the model
was traced again inside it); where no graph of the module was captured for this tap (another
tap used up the limit), the refusal says it is unknown whether the name is a site.
"""

from __future__ import annotations

import pytest
import torch
from life_reference import edit_fn
from life_twice import tapped_twice, use_up_limit, x_of

import fxprobe


@pytest.fixture(autouse=True)
def _fresh() -> None:
    torch._dynamo.reset()  # dynamo caches per code object: each test starts afresh


@pytest.mark.parametrize("rehook", [False, True])
def test_a_misspelt_name_in_a_fallen_module_is_said_misspelt(rehook: bool) -> None:
    misspelt = r"'inner\.relu_9' matches no site.*Closest site names: inner\.relu_1"
    with tapped_twice() as tapped:
        with pytest.raises(fxprobe.SelectorError, match=misspelt) as left:
            with tapped.intervene({"inner.relu_9": edit_fn(2.0, None)}):
                tapped(x_of((3, 4), 0))  # dynamo ran a whole call of Inner: its sites known
                if rehook:  # the model traced again: the new program captures nothing
                    tapped.get_submodule("inner.fc").register_forward_hook(
                        lambda m, args, out: None)
                with pytest.raises(fxprobe.DynamoError, match="recompile_limit"):
                    tapped(x_of((2, 3, 4), 1))  # past the limit: refused
                with pytest.raises(fxprobe.SelectorError, match=misspelt) as refused:
                    tapped(x_of((4,), 2))
                assert "only dynamo's graphs reached" not in str(refused.value)
        assert not isinstance(left.value, fxprobe.DynamoError)  # not the limit's doing


@pytest.mark.parametrize("name", ["inner.relu_1", "inner.relu_9"])
def test_a_name_in_a_module_no_graph_was_captured_of_is_said_unknown(name: str) -> None:
    x = x_of((3, 4), 0)
    use_up_limit(x)  # dynamo's limit for Inner's code
    with tapped_twice() as tapped:
        with pytest.raises(fxprobe.DynamoError, match="recompile_limit"):
            with tapped.intervene({name: edit_fn(2.0, None)}):
                with pytest.raises(fxprobe.DynamoError, match="recompile_limit"):
                    tapped(x)  # dynamo refused at its first call: the block is refused
                with pytest.raises(fxprobe.DynamoError) as refused:
                    tapped(x)
                said = str(refused.value)
                assert "only dynamo's graphs reached" not in said
                assert "before it captured any graph of it" in said
                assert "misspelt" in said and repr(name) in said
                assert "'inner.fc'" in said  # the names that are sites there
