"""What runs a tapped model or artifact: programs built from frontends, ``TappedModule``,
artifacts, the extractor and timm-style features."""
