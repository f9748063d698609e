"""specserve: the engine is ``specserve.engine`` (the ``engine/`` folder), the server
``specserve.deployments``, the cluster launchers ``specserve.cluster``, the conversion and
training tools ``specserve.modelbuild``; ``cli.py`` is the ``specserve`` command and
``chat.py`` its interactive chat."""
from pathlib import Path as _Path

_TREE = _Path(__file__).resolve().parent.parent
if (_TREE / "pyproject.toml").is_file() and (_TREE / "engine" / "__init__.py").is_file():
    # A source tree: its folders are this package's subpackages even where it is not the
    # installed one (a second git worktree, as bench/compare_commits.py makes, or
    # PYTHONPATH=.); an install maps them the same way (setup.py).
    __path__.append(str(_TREE))
