"""Per-call edits and caches on torchvision and timm models, which torch.fx traces whole (they
raised ConfigError there before): ablating channels of a ResNet stage's output per call, editing
a functional op (``torch.flatten``, the residual ``add`` of a BasicBlock), a ViT block's output,
each against forward hooks on the untapped model.

torchvision and timm live in another venv (see tests/test_torchvision.py): the checks run
there, with this checkout first on the path; without it these tests skip and say why.
"""

from __future__ import annotations

import textwrap

from tv_venv import TvJob, run_tv, uses_tv

_SCRIPT = textwrap.dedent("""
    import torch, timm, torchvision, fxprobe
    torch.set_num_threads(1)

    def hooked(model, x, edits):  # edits: [(module, "forward" | "pre", fn, call number)]
        handles = []
        for module, kind, fn, call in edits:
            seen = [0]
            def out_hook(m, a, o, fn=fn, call=call, seen=seen):
                seen[0] += 1
                return fn(o) if seen[0] - 1 == call else None
            def pre_hook(m, a, fn=fn, call=call, seen=seen):
                seen[0] += 1
                return (fn(a[0]), *a[1:]) if seen[0] - 1 == call else None
            handles.append(module.register_forward_hook(out_hook) if kind == "forward"
                           else module.register_forward_pre_hook(pre_hook))
        try:
            return model(x)
        finally:
            for h in handles:
                h.remove()

    def ablate(v):
        v = v.clone()
        v[:, :16] = 0
        return v

    torch.manual_seed(0)
    resnet = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    y = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        plain = resnet(x)
        ref = hooked(resnet, x, [(resnet.layer2, "forward", ablate, 0)])
        add_ref = hooked(resnet, x, [(resnet.layer1[0].relu, "pre", lambda v: v * 0.5, 1)])
        flat_ref = hooked(resnet, x, [(resnet.fc, "pre", lambda v: v[:, :256].repeat(1, 2), 0)])
    for tracer in ["auto", "hooks", "dynamo"]:
        tapped = fxprobe.tap(resnet, ops="layer3", tracer=tracer)
        with torch.no_grad():
            for _ in range(2):  # a block per call, a call between
                with tapped.intervene({"layer2": lambda s, v: ablate(v)}):
                    assert torch.equal(tapped(x), ref), tracer
                    assert tapped(y).shape == (1, 10)  # another shape in the block
                assert torch.equal(tapped(x), plain), tracer
            out, cache = tapped.run_with_cache(x, names=["layer2", "layer3"])
        kept = {}
        hs = [resnet.layer2.register_forward_hook(lambda m, a, o: kept.setdefault("2", o)),
              resnet.layer3.register_forward_hook(lambda m, a, o: kept.setdefault("3", o))]
        with torch.no_grad():
            resnet(x)
        for h in hs:
            h.remove()
        assert torch.equal(cache["layer2"], kept["2"]) and torch.equal(cache["layer3"], kept["3"])
        if tracer != "hooks":  # functional ops: no module, no hook site
            with torch.no_grad():
                with tapped.intervene({"layer1.0.*add": lambda s, v: v * 0.5}):
                    assert torch.equal(tapped(x), add_ref), tracer
                with tapped.intervene({"flatten": lambda s, v: v[:, :256].repeat(1, 2)}):
                    assert torch.equal(tapped(x), flat_ref), tracer
        # gradients flow through the edit, as through the hook's
        tapped(x).sum().backward()  # (the plain forward's, to compare the edited one with)
        resnet.zero_grad()
        with tapped.intervene({"layer2": lambda s, v: ablate(v)}):
            tapped(x).sum().backward()
        got = resnet.conv1.weight.grad.clone()
        resnet.zero_grad()
        hooked(resnet, x, [(resnet.layer2, "forward", ablate, 0)]).sum().backward()
        assert torch.allclose(got, resnet.conv1.weight.grad, atol=1e-6), tracer
        resnet.zero_grad()
        print("resnet18 ok", tracer)

    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                            patch_size=8, depth=2, embed_dim=32, num_heads=2,
                            num_classes=5).eval()
    z = torch.randn(2, 3, 32, 32)
    edit = lambda v: torch.cat([v[:, :1] * 0, v[:, 1:]], dim=1)  # the class token zeroed
    with torch.no_grad():
        ref = hooked(vit, z, [(vit.blocks[0], "forward", edit, 0)])
        plain = vit(z)
        tapped = fxprobe.tap(vit, ops="blocks.1")
        with tapped.intervene({"blocks.0": lambda s, v: edit(v)}):
            assert torch.equal(tapped(z), ref)
            kept = tapped.taps["blocks.1"]
        assert torch.equal(tapped(z), plain)
        want = []
        h = vit.blocks[1].register_forward_hook(lambda m, a, o: want.append(o))
        hooked(vit, z, [(vit.blocks[0], "forward", edit, 0)])
        h.remove()
        assert torch.equal(kept, want[0])  # the tap keeps the value after the edit
        _, cache = tapped.run_with_cache(z, names=["blocks.0", "blocks.1"])
        assert torch.equal(cache["blocks.1"], tapped.taps["blocks.1"])
    print("vit ok", sorted(cache))
""")


@uses_tv(TvJob(_SCRIPT))
def test_resnet18_and_a_vit_are_edited_per_call_as_hooks_edit_them() -> None:
    stdout = run_tv(TvJob(_SCRIPT))
    for tracer in ["auto", "hooks", "dynamo"]:
        assert f"resnet18 ok {tracer}" in stdout, stdout
    assert "vit ok ['blocks.0', 'blocks.1']" in stdout, stdout
