"""Pure planning over recorded traces: records, cuts, step detection, liveness and memory plans.

Installed as ``deferfuse.scheduler``; never imports jax.
"""
if __name__ != "deferfuse.scheduler":  # see NOTE [one copy of the registries]
    raise ImportError(
        f"the scheduler package was imported as {__name__!r}; it is part of deferfuse and must be "
        "imported as 'deferfuse.scheduler' (install the project with pip install -e . and "
        "import deferfuse)")
