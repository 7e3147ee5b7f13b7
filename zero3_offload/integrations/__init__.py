"""Optional adapters for third-party libraries; importing this package does not import them.

Each module imports its library (e.g. ``transformers``) only when one of its functions is
called, so ``zero3_offload`` works without them installed.
"""
