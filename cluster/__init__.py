"""Running specserve on Ray clusters: manifests (YAML) and the local-head helper."""
