"""Ray Serve deployments of specserve: thin adapters that move the engine's round
messages between processes (``engine/`` holds the algorithm; nothing here decides
tokens). ``builder.build_app`` assembles the application; ``serve_config.yaml`` at the
project root configures it."""
