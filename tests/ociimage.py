"""OCI images written by tests: layer tars, image layouts, descriptors (shared by the walker and build tests)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import zstandard

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
TAR = "application/vnd.oci.image.layer.v1.tar"
TAR_GZIP = TAR + "+gzip"
TAR_ZSTD = TAR + "+zstd"


def member(name: str, data: bytes | None = None, kind: bytes = tarfile.REGTYPE, mode: int = 0o644,
           mtime: int = 1_600_000_000, **attrs) -> tuple[tarfile.TarInfo, bytes | None]:  # fmt: skip
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = mode
    ti.mtime = mtime
    ti.size = len(data) if data is not None else 0
    for key, value in attrs.items():
        setattr(ti, key, value)
    return ti, data


def directory(name: str, mode: int = 0o755, mtime: int = 1_600_000_000) -> tuple:
    return member(name, kind=tarfile.DIRTYPE, mode=mode, mtime=mtime)


def layer_tar(*members) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for ti, data in members:
            archive.addfile(ti, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


COMPRESS = {TAR: lambda data: data, TAR_GZIP: gzip.compress, TAR_ZSTD: zstandard.ZstdCompressor().compress}


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Layout:
    """An OCI image layout directory, written blob by blob."""

    def __init__(self, root: Path):
        self.root = root
        (root / "blobs" / "sha256").mkdir(parents=True)
        (root / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))

    def blob(self, data: bytes, media_type: str, **extra) -> dict:
        (self.root / "blobs" / "sha256" / sha256(data)[7:]).write_bytes(data)
        return {"mediaType": media_type, "digest": sha256(data), "size": len(data), **extra}

    def path(self, descriptor: dict) -> Path:
        return self.root / "blobs" / "sha256" / descriptor["digest"][7:]

    def image(self, layers: list[tuple[str, bytes]], *, arch: str = "amd64",
              config_type: str = OCI_CONFIG) -> dict:  # fmt: skip
        """Manifest descriptor of an image of (media type, uncompressed tar) layers."""
        config = {"architecture": arch, "os": "linux",
                  "rootfs": {"type": "layers", "diff_ids": [sha256(tar) for _, tar in layers]}}  # fmt: skip
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": self.blob(json.dumps(config).encode(), config_type),
            "layers": [self.blob(COMPRESS[media_type](tar), media_type) for media_type, tar in layers],
        }
        return self.blob(json.dumps(manifest).encode(), OCI_MANIFEST)

    def index(self, *manifests: dict) -> None:
        (self.root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": list(manifests)}))


def single_image(tmp_path: Path, *layers: tuple[str, bytes], **kw) -> Layout:
    layout = Layout(tmp_path / "layout")
    layout.index(layout.image(list(layers), **kw))
    return layout
