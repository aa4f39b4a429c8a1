"""Loading deferfuse's C++ extension (``deferfuse._tpu_tensor``, the plain tpu tensor's kernels):
the torch version it was built for is read from the file first (NOTE [extension build] in
setup.py), so a library built for another torch (another C++ ABI) is never loaded; ``require``
turns a missing or mismatched build into an ImportError naming the fix (NOTE [tensor
representation] in plain.py)."""
from __future__ import annotations

import torch

_MARK = b"deferfuse-built-for-torch:"


def built_for(path: str) -> str | None:
    """The torch version the library at ``path`` was built for (NOTE [extension build] in setup.py),
    read from the file without loading it; None when it records none (built before the mark)."""
    import mmap
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        i = m.find(_MARK)
        if i < 0:
            return None
        j = m.find(b"\0", i)
        return m[i + len(_MARK):j].decode()


REBUILD = ("rebuild it against this torch: in a clone, `make` (or `python setup.py build_ext "
           "--inplace`); an installed deferfuse, `pip install --no-build-isolation "
           "--force-reinstall --no-deps <deferfuse source>`")


def load():
    """The C++ extension, or None (with the reason and the fix) when it is not built for this
    torch. The version it was built for is read from the file first: a library built for another
    torch (another C++ ABI) is never loaded."""
    import importlib.util
    spec = importlib.util.find_spec(f"{__package__}._tpu_tensor")
    if spec is None or not spec.origin:
        return None, ("deferfuse's C++ extension deferfuse._tpu_tensor is not built; build it: "
                      "in a clone, `make` (or `python setup.py build_ext --inplace`); an installed "
                      "deferfuse, reinstall it with a C++ compiler present (docs/architecture.md)")
    built = built_for(spec.origin)
    if built != torch.__version__:
        return None, (f"deferfuse's C++ extension {spec.origin} was built for torch "
                      f"{built or 'of an older deferfuse'}, this is torch {torch.__version__}: "
                      + REBUILD)
    from . import _tpu_tensor
    return _tpu_tensor, None


def require():
    """The C++ extension, or ImportError naming the fix (NOTE [tensor representation])."""
    ext, why = load()
    if ext is None:
        raise ImportError(f"the tpu tensor needs the C++ extension: {why}")
    return ext
