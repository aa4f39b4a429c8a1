"""The JAX side of deferfuse: lowering table, compile cache, execution and transfers.

Installed as ``deferfuse.runtime``.
"""
# NOTE [one copy of the registries]: the lowering table and caches are module state. Importing this
# folder under another name (``import runtime`` from the repository root) would build a second,
# empty copy of them, so refuse it.
if __name__ != "deferfuse.runtime":
    raise ImportError(
        f"the runtime package was imported as {__name__!r}; it is part of deferfuse and must be "
        "imported as 'deferfuse.runtime' (install the project with pip install -e . and "
        "import deferfuse)")
