"""Frontends: turn a model or an artifact into graphs whose nodes carry their ``Site``s (fx,
hooks, dynamo, TorchScript IR, torch.export). Import ``core`` and ``capture`` only."""
