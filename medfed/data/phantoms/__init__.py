"""Generated data sets written in the real data sets' on-disk layouts.

Everything here is *generated*: results computed on it must be labelled as
such. Each generator is deterministic from its seed and caches its output (a
``GENERATED.json`` marker records the parameters).
"""
