"""The ``specserve`` command (``cli.py``) and its interactive chat (``chat.py``). The
engine is ``engine``, the server ``deployments``, the cluster launchers ``cluster``."""
