"""A model bundle on disk: a directory with ``manifest.json`` naming the target, the
draft model and the heads. The engine, the proposer replicas and the router all find
their files through this one object."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specserve.engine.errors import ModelLoadError
from specserve.engine.model.manifest import MANIFEST_NAME, BundleManifest


@dataclass(frozen=True)
class Bundle:
    directory: Path
    manifest: BundleManifest

    @classmethod
    def load(cls, directory: str | Path) -> "Bundle":
        directory = Path(directory)
        return cls(directory, BundleManifest.load(directory))

    @property
    def name(self) -> str:
        """What the server calls the model (``/v1/models``) unless told otherwise."""
        return self.manifest.name or self.directory.resolve().name

    @property
    def target_dir(self) -> Path:
        return self.directory / self.manifest.models["target"].directory

    @property
    def target_hidden_size(self) -> int:
        return self.manifest.models["target"].architecture.hidden_size

    @property
    def final_hidden_output(self) -> str:
        return self.manifest.models["target"].hidden_outputs.final

    def has_draft(self) -> bool:
        return "draft" in self.manifest.models

    def draft_dir(self) -> Path:
        if not self.has_draft():
            raise ModelLoadError(f"the bundle at {self.directory} has no draft model")
        return self.directory / self.manifest.models["draft"].directory

    def has_head(self, kind: str) -> bool:
        return kind in self.manifest.heads

    def head_dir(self, kind: str) -> Path:
        entry = self.manifest.heads.get(kind)
        if entry is None:
            raise ModelLoadError(f"the bundle at {self.directory} has no '{kind}' head")
        return self.directory / entry.directory

    def head_config(self, kind: str) -> dict:
        return json.loads((self.head_dir(kind) / "config.json").read_text())


def resolve_model_path(path: str | Path) -> tuple[Path, Bundle | None]:
    """(target model dir, its bundle if any) for a bundle dir or a model dir inside one."""
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        bundle = Bundle.load(path)
        return bundle.target_dir, bundle
    if (path.parent / MANIFEST_NAME).is_file():
        bundle = Bundle.load(path.parent)
        if bundle.manifest.models.get("target") and bundle.target_dir.resolve() == path.resolve():
            return path, bundle
    return path, None
