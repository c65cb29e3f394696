"""fxprobe's overhead benchmark suite (outside the wheel): ``python -m benchmarks``.

It times fxprobe taps against forward hooks, a global module hook, the ``.item()`` logging hook
and the bare model, on the same sites, in interleaved rounds, and writes JSON records, a Markdown
report and (with matplotlib) a plot. See ``docs/benchmarks.md``. Nothing runs on import.
"""
