"""Where captured values go: disk shards and their reader, loggers, torch.distributed."""
