"""specserve: the engine is ``specserve.engine`` (the ``engine/`` folder), the server
``specserve.deployments``, the cluster launchers ``specserve.cluster``, the conversion and
training tools ``specserve.modelbuild``; ``cli.py`` is the ``specserve`` command and
``chat.py`` its interactive chat."""
from __future__ import annotations

from pathlib import Path as _Path

_parent = _Path(__file__).resolve().parent.parent
# The source tree this package sits in, or None where it is installed from a wheel.
SOURCE_TREE: _Path | None = (_parent if (_parent / "pyproject.toml").is_file()
                             and (_parent / "engine" / "__init__.py").is_file() else None)
if SOURCE_TREE is not None:
    # Its folders are this package's subpackages even where it is not the installed one (a
    # second git worktree, as bench/compare_commits.py makes, or PYTHONPATH=.); an install
    # maps them the same way (setup.py).
    __path__.append(str(SOURCE_TREE))
