"""Where each kind of object lives in a store. The one place that spells out key names.

    packs/<hh>/<pack id>        zstd-compressed chunks, many per object (see pack.py)
    index/<hh>/<pack id>        the pack's index: chunk digest -> offset, compressed and plain length
    layers/<layer digest>/meta.erofs   the EROFS metadata image
    layers/<layer digest>/blobmap      the virtual blob's map: blocks -> chunk digests
    layers/<layer digest>/buildinfo    optional: source file identities for incremental rebuilds
    layers/<layer digest>/manifest.json   written last; its presence publishes the layer
    refs/<name>:<tag>           text: the layer digest the name points at
    leases/<lease id>           JSON: a build in progress, which gc must not pull packs from under
    gc-locks/<lease id>         JSON: a gc run in progress; at most one runs at a time (leases.py)
    trash/<hh>/<pack id>        JSON: when gc soft-deleted the pack by removing its index (gc.py)
    profiles/layers/<layer digest>/<node id>   JSON: what sandboxes on that node read of the layer first
    profiles/names/<sha256 of a ref name>/<node id>   the same, under the layer's name (lazy_fetch/profile.py)
    profiles/combinations/<combination id>/<layer digest>/<node id>   the same, of the layer as part of one
                                                 stack of layers (lazy_fetch/trace_holders.combination_id)

<hh> is the first two hex characters of the id: a fan-out that keeps directories of POSIX stores small
and spreads S3 key prefixes. A ref object's text is spelled out here too (``ref_body``, ``ref_target``):
its writer (dsec_fs.layer) and the node's ref cache (ref_cache.py) both read it.
"""

from __future__ import annotations

from ..digest import is_hex_digest

PACKS = "packs/"
INDEX = "index/"
LAYERS = "layers/"
REFS = "refs/"
LEASES = "leases/"
GC_LOCKS = "gc-locks/"
TRASH = "trash/"
PROFILES = "profiles/"


def pack(pack_id: str) -> str:
    return f"{PACKS}{pack_id[:2]}/{pack_id}"


def index(pack_id: str) -> str:
    return f"{INDEX}{pack_id[:2]}/{pack_id}"


def layer_meta(layer: str) -> str:
    return f"{LAYERS}{layer}/meta.erofs"


def layer_blobmap(layer: str) -> str:
    return f"{LAYERS}{layer}/blobmap"


def layer_buildinfo(layer: str) -> str:
    return f"{LAYERS}{layer}/buildinfo"


def layer_manifest(layer: str) -> str:
    return f"{LAYERS}{layer}/manifest.json"


def ref(name: str, tag: str) -> str:
    return f"{REFS}{name}:{tag}"


def ref_body(digest: str) -> bytes:
    """What the ref object of a ref pointing at layer ``digest`` holds."""
    return f"{digest}\n".encode()


def ref_target(body: bytes) -> str | None:
    """The layer digest a ref object's ``body`` names, or None when it holds no digest (cut short, or
    damaged)."""
    text = body.decode("ascii", errors="replace").strip()
    return text if is_hex_digest(text) else None


def trash(pack_id: str) -> str:
    return f"{TRASH}{pack_id[:2]}/{pack_id}"


def id_from_key(key: str) -> str:
    """The last path component: the pack id of a packs/ or index/ key."""
    return key.rsplit("/", 1)[-1]


def layer_profiles(layer: str) -> str:
    """The prefix of the profile objects of a layer (one per node)."""
    return f"{PROFILES}layers/{layer}/"


def combination_profiles(combination: str, layer: str) -> str:
    """The prefix of the profile objects of a layer in one combination of layers (one per node)."""
    return f"{PROFILES}combinations/{combination}/{layer}/"


def name_profiles(name_id: str) -> str:
    """The prefix of the profile objects of a ref name (one per node)."""
    return f"{PROFILES}names/{name_id}/"
