"""Which image a build source names, opened for walk_oci: a registry reference or a local layout.

    docker://HOST[:PORT]/REPO[:TAG|@sha256:HEX]   a registry (walk_registry.py)
    oci:DIR[:TAG]                                  an OCI image layout, the image tagged TAG in it
    a path                                         a layout directory, or an OCI or docker-archive tar

A source that starts with ``docker://`` or ``oci:`` is always a reference, never a path.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # open_image imports them: telling a reference from a path needs none of them
    from .registry import RegistryOptions
    from .walk_oci import OciImage

REGISTRY_PREFIX = "docker://"
LAYOUT_PREFIX = "oci:"


def is_image_ref(source: str | bytes | os.PathLike) -> bool:
    """Whether ``source`` is a ``docker://`` or ``oci:`` reference (not a path)."""
    text = os.fsdecode(source)
    return text.startswith(REGISTRY_PREFIX) or text.startswith(LAYOUT_PREFIX)


def split_layout_ref(text: str) -> tuple[str, str | None]:
    """``oci:DIR[:TAG]`` as (DIR, TAG or None). A last ``:`` part with no ``/`` in it is the tag."""
    rest = text[len(LAYOUT_PREFIX):]
    directory, colon, tag = rest.rpartition(":")
    if colon and directory and "/" not in tag:
        return directory, tag
    return rest, None


def open_image(source: str | os.PathLike, platform: str = "linux/amd64",
               registry: RegistryOptions | None = None) -> OciImage:
    """The image for ``platform`` that ``source`` names (see the module docstring)."""
    from .registry import RegistryOptions, parse_image_ref
    from .walk_oci import open_oci_image
    from .walk_registry import open_registry_image

    text = os.fsdecode(source)
    if text.startswith(REGISTRY_PREFIX):
        return open_registry_image(parse_image_ref(text), platform, registry or RegistryOptions())
    if text.startswith(LAYOUT_PREFIX):
        directory, tag = split_layout_ref(text)
        return open_oci_image(os.path.abspath(directory), platform, tag)
    return open_oci_image(os.path.abspath(text), platform)
