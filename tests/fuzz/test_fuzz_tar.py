"""Fuzzing the build inputs: tar streams (walk_tar: plain, gzip, zstd) and OCI images (walk_oci: layout
directories, and docker-archive / layout tars), under fuzzlib's time and memory bounds.

Contract: a hostile archive is refused with InputError (UnsupportedError for a compression or feature we
do not read; IntegrityError when an OCI blob does not match its descriptor) and nothing else; what is
accepted is sound: every path is a clean relative path of valid names, every regular file's content
arrives as exactly ``size`` bytes in chunk-size pieces, and a tar that walks builds into a layer that
fsck passes and whose reader shows exactly the tree walk_tar produced.

Structure-aware inputs: archives made by tarfile (ustar, GNU, PAX with every extension we read) and by
GNU tar (sparse formats), mutated byte-wise, header field by field (checksum recomputed), or block by
block (blocks dropped, repeated, swapped); then compressed or not. OCI images are generated with their
descriptors computed after a document was mutated, so the mutation reaches the parser instead of
stopping at a digest check (and sometimes a blob is damaged after the fact, which must be an
IntegrityError).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from dsec_fs.errors import InputError, IntegrityError, UnsupportedError
from dsec_fs.layer import open_layer
from dsec_fs.store import FilesystemStore
from erofs_builder.blob import StoreBlob
from erofs_builder.build import build_tree
from erofs_builder.fsck import fsck_layer
from erofs_builder.reader import ErofsImage
from erofs_builder.tree import NAME_MAX, Tree
from erofs_builder.walk_oci import walk_oci
from erofs_builder.walk_tar import TarLimits, tar_nodes, walk_tar
from fuzzlib import INTERESTING, bounded, corpus_cases, fuzz_settings, inputs, json_mutations, mutations, note
from tarextract import extract_tar

BLOCK = 512
CHUNK = 4096
# Small limits keep every example cheap (a 1 TiB sparse file is legal by default and takes a while to
# chunk); they are exercised as limits too.
LIMITS = TarLimits(max_file_size=16 << 20, max_header_size=64 << 10, max_sparse_segments=512,
                   max_tar_bytes=64 << 20, expansion_allowance=16 << 20)
TAR_ERRORS = (InputError, UnsupportedError)
OCI_ERRORS = (InputError, UnsupportedError, IntegrityError)
SCRATCH = tempfile.TemporaryDirectory(prefix="dsecfs-fuzz-tar-")


# ---------------------------------------------------------------------------------------------------------
# Seeds.


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes | None = None, **attrs):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mtime = attrs.pop("mtime", 1_600_000_000)
    info.mode = attrs.pop("mode", 0o644)
    for key, value in attrs.items():
        setattr(info, key, value)
    info.size = len(data) if data is not None else 0
    return info, data


def make_tar(members, fmt, global_headers: dict[str, str] | None = None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt, pax_headers=global_headers) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def tarfile_seeds() -> list[bytes]:
    members = [
        _member("d", tarfile.DIRTYPE, mode=0o755),
        _member("d/file", data=b"hello\n" * 700),
        _member("d/empty", data=b""),
        _member("d/link", tarfile.SYMTYPE, linkname="file"),
        _member("d/hard", tarfile.LNKTYPE, linkname="d/file"),
        _member("dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666),
        _member("dev/blk", tarfile.BLKTYPE, devmajor=259, devminor=70_000),
        _member("fifo", tarfile.FIFOTYPE),
        _member("zeros", data=bytes(3 * CHUNK + 1)),
        _member("./dot/x", data=b"x", uid=70_000, gid=3_000_000_000),
        _member("n" * 200 + "/long", data=b"a long name"),
        _member("t", data=b"t", linkname="l" * 150, mode=0o4755),
    ]
    pax = [*members, _member("pax", data=b"xattrs", pax_headers={
        "SCHILY.xattr.user.k": "v", "LIBARCHIVE.xattr.user.b64": "aGVsbG8", "mtime": "1600000000.123456789",
        "RHT.security.selinux": "system_u:object_r:bin_t:s0", "uid": "4000000000"})]
    seeds = [make_tar(pax, tarfile.PAX_FORMAT), make_tar(members, tarfile.GNU_FORMAT)]
    short = [(info, data) for info, data in members if len(info.name) < 100 and len(info.linkname) < 100
             and info.uid < 0o7777777 and info.gid < 0o7777777 and info.devminor < 0o7777777]
    seeds.append(make_tar(short, tarfile.USTAR_FORMAT))
    seeds.append(make_tar([_member("g", data=b"g")], tarfile.PAX_FORMAT, {"comment": "git", "path": "ignored"}))
    return seeds


def gnu_tar_seeds(directory: str) -> list[bytes]:
    """Sparse members in each format GNU tar writes (old GNU 'S', PAX 0.0, 0.1 and 1.0), when tar is here."""
    if shutil.which("tar") is None:
        return []
    root = os.path.join(directory, "gnu-src")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "sparse"), "wb") as f:
        f.truncate(40 * CHUNK)
        for offset in (0, 9 * CHUNK + 5, 30 * CHUNK):
            f.seek(offset)
            f.write(b"data" * 300)
    with open(os.path.join(root, "after"), "wb") as f:
        f.write(b"after the sparse file")
    for name in ("sparse", "after"):  # the same seeds every run
        os.utime(os.path.join(root, name), ns=(0, 1_600_000_000_000_000_000))
    seeds = []
    stable = "--pax-option=delete=atime,delete=ctime"  # PAX archives record these times otherwise
    for options in (["--format=gnu"], ["--format=posix", "--sparse-version=0.0", stable],
                    ["--format=posix", "--sparse-version=0.1", stable],
                    ["--format=posix", "--sparse-version=1.0", stable]):
        archive = os.path.join(directory, "gnu.tar")
        done = subprocess.run(["tar", "--sparse", *options, "--numeric-owner", "--owner=0", "--group=0",
                               "-C", root, "-cf", archive, "sparse", "after"], capture_output=True)
        if done.returncode == 0:
            with open(archive, "rb") as f:
                seeds.append(_without_pid(f.read()))
    return seeds


def _without_pid(archive: bytes) -> bytes:
    """GNU tar names the sparse members of PAX archives ./GNUSparseFile.<its pid>/NAME: make that stable."""
    out = bytearray(archive)
    for at in range(0, len(out) - BLOCK + 1, BLOCK):
        name = bytes(out[at:at + 100]).split(b"\0")[0]
        if name.startswith(b"./GNUSparseFile.") and out[at + 257:at + 262] == b"ustar":
            out[at:at + 100] = (b"./GNUSparseFile.0/" + name.split(b"/", 2)[2]).ljust(100, b"\0")
            block = out[at:at + BLOCK]
            reseal_header(block)
            out[at:at + BLOCK] = block
    return bytes(out)


# ---------------------------------------------------------------------------------------------------------
# Tar-aware mutations.

# Header fields: (offset, width, kind).
FIELDS = {"name": (0, 100, "path"), "mode": (100, 8, "number"), "uid": (108, 8, "number"),
          "gid": (116, 8, "number"), "size": (124, 12, "number"), "mtime": (136, 12, "number"),
          "typeflag": (156, 1, "type"), "linkname": (157, 100, "path"), "magic": (257, 8, "magic"),
          "devmajor": (329, 8, "number"), "devminor": (337, 8, "number"), "prefix": (345, 155, "path"),
          "gnu sparse": (386, 97, "bytes"), "gnu realsize": (483, 12, "number")}
TYPEFLAGS = b"0123456789ADgxLKSVMN\0"
PATHS = [b"", b"/", b".", b"..", b"../escape", b"/abs/x", b"a/./b", b"a//b", b"d", b"d/file", b"a\xffb",
         b"x" * 100, b"./", b"a/../b", b".wh.file", b".wh..wh..opq"]
MAGICS = [b"ustar\x0000", b"ustar  \x00", bytes(8), b"garbage!"]


def _number_field(draw, width: int) -> bytes:
    value = draw(st.sampled_from(INTERESTING), label="value")
    style = draw(st.sampled_from(["octal", "octal", "base-256", "negative", "garbage"]), label="style")
    if style == "octal":
        text = b"%o" % value
        return text[-(width - 1):].rjust(width - 1, b"0") + b"\0"
    if style in ("base-256", "negative"):
        magnitude = value % (1 << (8 * width - 2))
        raw = (-magnitude if style == "negative" else magnitude) % (1 << (8 * width - 1))
        return bytes([0x80 | (0x40 if style == "negative" else 0) | raw >> (8 * (width - 1)) & 0x3F]) + (
            raw % (1 << (8 * (width - 1)))).to_bytes(width - 1, "big")
    return draw(st.binary(min_size=width, max_size=width), label="garbage")


def reseal_header(block: bytearray) -> None:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)


def resealed_headers(data: bytes) -> bytes:
    """Every block that looks like a ustar/GNU header gets a correct checksum, so byte mutations in
    headers reach the field parsers."""
    out = bytearray(data)
    for at in range(0, len(out) - BLOCK + 1, BLOCK):
        if out[at + 257:at + 262] == b"ustar":
            block = out[at:at + BLOCK]
            reseal_header(block)
            out[at:at + BLOCK] = block
    return bytes(out)


@st.composite
def tar_edits(draw, seed: bytes) -> bytes:
    """A seed with header fields replaced (checksums recomputed) and whole blocks dropped, repeated or
    swapped."""
    data = bytearray(seed)
    headers = [i for i in range(0, len(data) - BLOCK + 1, BLOCK) if data[i + 257:i + 262] == b"ustar"]
    for _ in range(draw(st.integers(1, 4), label="edits")):
        blocks = len(data) // BLOCK
        what = draw(st.sampled_from(["field", "field", "field", "drop", "repeat", "swap"]), label="edit")
        if what == "field" and headers:
            at = draw(st.sampled_from(headers), label="header")
            name, (offset, width, kind) = draw(st.sampled_from(sorted(FIELDS.items())), label="field")
            if kind == "number":
                value = _number_field(draw, width)
            elif kind == "path":
                value = draw(st.sampled_from(PATHS), label="path")[:width].ljust(width, b"\0")
            elif kind == "type":
                value = bytes([draw(st.sampled_from(TYPEFLAGS), label="type")])
            elif kind == "magic":
                value = draw(st.sampled_from(MAGICS), label="magic")
            else:
                value = draw(st.binary(min_size=width, max_size=width), label="bytes")
            block = bytearray(data[at:at + BLOCK])
            block[offset:offset + width] = value
            reseal_header(block)
            data[at:at + BLOCK] = block
        elif what in ("drop", "repeat", "swap") and blocks > 1:
            i = draw(st.integers(0, blocks - 1), label="block")
            j = draw(st.integers(0, blocks - 1), label="other block")
            a, b = data[i * BLOCK:(i + 1) * BLOCK], data[j * BLOCK:(j + 1) * BLOCK]
            if what == "drop":
                del data[i * BLOCK:(i + 1) * BLOCK]
            elif what == "repeat":
                data[j * BLOCK:j * BLOCK] = a
            else:
                data[i * BLOCK:(i + 1) * BLOCK], data[j * BLOCK:(j + 1) * BLOCK] = b, a
            headers = [h for h in range(0, len(data) - BLOCK + 1, BLOCK) if data[h + 257:h + 262] == b"ustar"]
    return bytes(data)


def compressed(data: bytes, how: str) -> bytes:
    if how == "gzip":
        return gzip.compress(data, mtime=0)
    if how == "zstd":
        return zstandard.ZstdCompressor(write_checksum=True).compress(data)
    if how == "zstd, two frames":
        half = len(data) // 2
        return b"".join(zstandard.ZstdCompressor(write_checksum=True).compress(p) for p in (data[:half], data[half:]))
    return data


@st.composite
def tars(draw) -> bytes:
    """A mutated archive, then (usually) plain; sometimes compressed, sometimes damaged after compressing."""
    seed = draw(st.sampled_from(TAR_SEEDS), label="seed")
    style = draw(st.sampled_from(["fields and blocks", "bytes", "fields then bytes", "anything"]), label="style")
    if style == "anything":
        data = draw(inputs(TAR_SEEDS, max_random=4096))
    else:
        data = draw(tar_edits(seed)) if style != "bytes" else seed
        if style != "fields and blocks":
            data = draw(mutations([data]))
            if draw(st.integers(0, 3), label="keep header checksums as they are") != 3:
                data = resealed_headers(data)
    how = draw(st.sampled_from(["plain", "plain", "gzip", "zstd", "zstd, two frames"]), label="compression")
    data = compressed(data, how)
    if how != "plain" and draw(st.integers(0, 3), label="damage the compressed bytes") == 3:
        data = draw(mutations([data]))
    return data


TAR_SEEDS = tarfile_seeds() + gnu_tar_seeds(SCRATCH.name)


# ---------------------------------------------------------------------------------------------------------
# Checks.


def check_path(path: bytes) -> None:
    assert not path.startswith(b"/") and not path.endswith(b"/")
    for name in path.split(b"/") if path else []:
        assert name not in (b"", b".", b"..") and b"\0" not in name, path


def read_content(node) -> bytes:
    """The content as the chunker reads it: ``size`` bytes in CHUNK pieces, None pieces being holes."""
    out = bytearray()
    count = -(-node.size // CHUNK)
    pieces = list(node.reader(CHUNK)) if node.size else []
    assert len(pieces) == count, f"{len(pieces)} pieces for {node.size} bytes"
    for k, piece in enumerate(pieces):
        length = min(CHUNK, node.size - k * CHUNK)
        assert piece is None or len(piece) == length, f"piece {k} is {len(piece)} bytes, not {length}"
        out += piece if piece is not None else bytes(length)
    return bytes(out)


class Reader:
    """on_file that reads every file as the chunker would and keeps its content; ``replayable`` then
    gives the tree's files readers over that content, so build_tree can chunk them afterwards."""

    def __init__(self):
        self.content: dict[int, bytes] = {}

    def __call__(self, node) -> None:
        self.content[id(node)] = read_content(node)

    def replayable(self, tree: Tree) -> None:
        for _path, node in tree.walk():
            content = self.content.get(id(node), b"")
            if node.is_reg:
                node.reader = lambda size, content=content: (content[i:i + size] for i in range(0, len(content), size))


def check_tree(tree: Tree) -> None:
    for path, node in tree.walk():
        check_path(path)
        assert not path or len(path.rpartition(b"/")[2]) <= NAME_MAX
        assert node.is_dir == (node.children is not None)


def walk_tar_checked(data: bytes, lenient: bool) -> Tree:
    for path, node in tar_nodes(io.BytesIO(data), source="fuzz.tar", lenient=lenient, limits=LIMITS):
        check_path(path)
        if node.reader is not None:
            read_content(node)
    reader = Reader()
    tree = walk_tar(io.BytesIO(data), on_file=reader, lenient=lenient, limits=LIMITS)
    check_tree(tree)
    return tree


def check_tar(data: bytes, lenient: bool) -> None:
    note(bounded(lambda: walk_tar_checked(data, lenient), allowed=TAR_ERRORS, input_size=len(data)))


@fuzz_settings(500)
@given(data=tars(), lenient=st.booleans())
def test_walk_tar(data, lenient):
    check_tar(data, lenient)


# ---------------------------------------------------------------------------------------------------------
# A tar that walks builds into a layer that shows exactly that tree.


@pytest.fixture(scope="module")
def build_store(tmp_path_factory):
    return FilesystemStore(str(tmp_path_factory.mktemp("fuzz-tar-builds")), fsync=False)


def assert_layer_shows(store, digest: str, tree: Tree, reader: Reader) -> None:
    report = fsck_layer(store, digest, check_chunks=True)
    assert report.ok, report.summary()
    files = open_layer(store, digest)
    image = ErofsImage(files.meta, blob=StoreBlob.for_layer(store, files))
    walked = [path for path, _nid in image.walk()]
    assert walked == [path for path, _node in tree.walk()]
    for path, node in tree.walk():
        st_ = image.stat(image.resolve(path))
        assert (st_.mode, st_.uid, st_.gid, st_.mtime_ns, st_.nlink) == (
            node.mode, node.uid, node.gid, node.mtime_ns, node.nlink), path
        assert image.xattrs(image.resolve(path)) == node.xattrs, path
        if node.is_reg:
            assert image.read(image.resolve(path), 0, node.size + 1) == reader.content.get(id(node), b""), path
        elif node.is_symlink:
            assert image.readlink(image.resolve(path)) == node.target
        elif stat.S_ISCHR(node.mode) or stat.S_ISBLK(node.mode):
            assert st_.rdev == (os.major(node.rdev), os.minor(node.rdev))


@fuzz_settings(120)
@given(data=st.data())
def test_a_tar_that_walks_builds_the_same_tree(build_store, data):
    seed = data.draw(st.sampled_from(TAR_SEEDS), label="seed")
    archive = data.draw(tar_edits(seed)) if data.draw(st.booleans(), label="edit fields") else seed
    if data.draw(st.booleans(), label="mutate bytes"):
        archive = resealed_headers(data.draw(mutations([archive])))
    reader = Reader()
    try:
        tree = walk_tar(io.BytesIO(archive), on_file=reader, lenient=True, limits=LIMITS)
    except TAR_ERRORS:
        note("refused")
        return
    reader.replayable(tree)
    outcome = bounded(lambda: build_tree(tree, build_store, chunk_size=CHUNK), allowed=TAR_ERRORS,
                      input_size=len(archive), memory=256 << 20)
    note("built" if not isinstance(outcome, Exception) else outcome)
    if not isinstance(outcome, Exception):
        assert_layer_shows(build_store, outcome.digest, tree, reader)


# ---------------------------------------------------------------------------------------------------------
# OCI images.

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_DOCUMENTS = ("layer tar", "layer blob", "config", "manifest", "index", "oci-layout", "manifest.json")
JSON_DOCUMENTS = ("config", "manifest", "index", "oci-layout", "manifest.json")

OCI_LAYER_TARS = [
    make_tar([_member("etc", tarfile.DIRTYPE), _member("etc/passwd", data=b"root:x:0:0\n"),
              _member("gone", data=b"deleted above"), _member("dir/keep", data=b"k"),
              _member("dir/old", data=b"o")], tarfile.PAX_FORMAT),
    make_tar([_member("etc/hostname", data=b"box\n"), _member(".wh.gone", data=b""),
              _member("dir/.wh..wh..opq", data=b""), _member("dir/new", data=b"n")], tarfile.PAX_FORMAT),
]


def _descriptor(data: bytes, media_type: str, **extra) -> dict:
    return {"mediaType": media_type, "digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data),
            **extra}


def oci_documents(override: dict[str, bytes], layer_index: int) -> dict[str, bytes]:
    """The documents of a two-layer image, bottom up; ``override`` replaces one (of layer ``layer_index``
    for the layer ones) and everything above it names the replacement by its own digest."""
    tars = list(OCI_LAYER_TARS)
    if "layer tar" in override:
        tars[layer_index] = override["layer tar"]
    blobs = [gzip.compress(t, mtime=0) for t in tars]
    if "layer blob" in override:
        blobs[layer_index] = override["layer blob"]
    config = override["config"] if "config" in override else json.dumps(
        {"architecture": "amd64", "os": "linux",
         "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(t).hexdigest() for t in tars]}}).encode()
    manifest = override["manifest"] if "manifest" in override else json.dumps(
        {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": _descriptor(config, OCI_CONFIG),
         "layers": [_descriptor(b, GZIP_LAYER) for b in blobs]}).encode()
    index = override["index"] if "index" in override else json.dumps(
        {"schemaVersion": 2, "manifests": [_descriptor(manifest, OCI_MANIFEST, platform={
            "os": "linux", "architecture": "amd64"})]}).encode()
    layout = override["oci-layout"] if "oci-layout" in override else b'{"imageLayoutVersion": "1.0.0"}'
    docs = {"index.json": index, "oci-layout": layout}
    for blob in [config, manifest, *blobs]:
        docs["blobs/sha256/" + hashlib.sha256(blob).hexdigest()] = blob
    # The docker-archive view of the same image (docker save >= 25 writes both): uncompressed layers.
    for t in tars:
        docs["blobs/sha256/" + hashlib.sha256(t).hexdigest()] = t
    docs["manifest.json"] = override["manifest.json"] if "manifest.json" in override else json.dumps(
        [{"Config": "blobs/sha256/" + hashlib.sha256(config).hexdigest(), "RepoTags": ["fuzz:1"],
          "Layers": ["blobs/sha256/" + hashlib.sha256(t).hexdigest() for t in tars]}]).encode()
    return docs


def canonical(document: str, layer_index: int) -> bytes:
    docs = oci_documents({}, layer_index)
    if document == "layer tar":
        return OCI_LAYER_TARS[layer_index]
    if document == "layer blob":
        return gzip.compress(OCI_LAYER_TARS[layer_index], mtime=0)
    if document in ("index", "oci-layout", "manifest.json"):
        return docs["index.json" if document == "index" else document]
    manifest = json.loads(docs["index.json"])["manifests"][0]["digest"].removeprefix("sha256:")
    if document == "manifest":
        return docs["blobs/sha256/" + manifest]
    config = json.loads(docs["blobs/sha256/" + manifest])["config"]["digest"].removeprefix("sha256:")
    return docs["blobs/sha256/" + config]


@st.composite
def oci_images(draw) -> tuple[dict[str, bytes], str]:
    """(documents by path, form): one document mutated and the image regenerated around it; sometimes a
    blob damaged after the fact, or a docker-archive without index.json."""
    document = draw(st.sampled_from(OCI_DOCUMENTS), label="document")
    layer_index = draw(st.integers(0, 1), label="layer")
    original = canonical(document, layer_index)
    if document == "layer tar":
        mutated = draw(tar_edits(original)) if draw(st.booleans()) else draw(mutations([original]))
    elif document in JSON_DOCUMENTS and draw(st.booleans(), label="edit as JSON"):
        mutated = draw(json_mutations([original]))
    else:
        mutated = draw(mutations([original]))
    docs = oci_documents({document: mutated}, layer_index)
    if draw(st.integers(0, 5), label="damage a blob after hashing") == 5:
        name = draw(st.sampled_from(sorted(name for name in docs if name.startswith("blobs/"))), label="blob")
        docs[name] = draw(mutations([docs[name]]))
    # A docker-archive is the same files without index.json, so manifest.json is what is read.
    form = draw(st.sampled_from(["directory", "archive", "docker-archive directory", "docker-archive"]),
                label="form")
    if form.startswith("docker-archive"):
        del docs["index.json"], docs["oci-layout"]
    return docs, form


def materialise(docs: dict[str, bytes], form: str, where: str) -> str:
    shutil.rmtree(where, ignore_errors=True)
    os.makedirs(where)
    if form.endswith("directory"):
        for name, data in docs.items():
            os.makedirs(os.path.join(where, os.path.dirname(name)), exist_ok=True)
            with open(os.path.join(where, name), "wb") as f:
                f.write(data)
        return where
    path = os.path.join(where, "image.tar")
    with open(path, "wb") as f:
        f.write(make_tar([_member(name, data=data) for name, data in sorted(docs.items())], tarfile.PAX_FORMAT))
    return path


def walk_oci_checked(path: str, flatten: bool) -> None:
    trees = walk_oci(path, on_file=Reader(), flatten=flatten, limits=LIMITS)
    for tree in [trees] if flatten else trees:
        check_tree(tree)


def check_oci(path: str, flatten: bool, input_size: int) -> None:
    note(bounded(lambda: walk_oci_checked(path, flatten), allowed=OCI_ERRORS, input_size=input_size))


@fuzz_settings(250)
@given(image=oci_images(), flatten=st.booleans())
def test_walk_oci(image, flatten):
    docs, form = image
    path = materialise(docs, form, os.path.join(SCRATCH.name, "oci"))
    check_oci(path, flatten, sum(map(len, docs.values())))


@fuzz_settings(200)
@given(data=st.data(), flatten=st.booleans())
def test_walk_oci_on_a_damaged_archive(data, flatten):
    """The tar holding a layout or docker-archive, damaged: tarfile indexes it, every blob is verified."""
    docs = oci_documents({}, 0)
    if data.draw(st.booleans(), label="docker-archive"):
        del docs["index.json"], docs["oci-layout"]
    archive = make_tar([_member(name, data=d) for name, d in sorted(docs.items())], tarfile.PAX_FORMAT)
    damaged = data.draw(tar_edits(archive)) if data.draw(st.booleans(), label="edit fields") else archive
    damaged = data.draw(mutations([damaged])) if data.draw(st.booleans(), label="mutate bytes") else damaged
    path = os.path.join(SCRATCH.name, "damaged.tar")
    with open(path, "wb") as f:
        f.write(damaged)
    check_oci(path, flatten, len(damaged))


# ---------------------------------------------------------------------------------------------------------
# The corpus.


def replay_oci_directory(data: bytes) -> None:
    """A layout directory kept as a tar of its files (the test's own, trusted: extracted with tarfile)."""
    where = os.path.join(SCRATCH.name, "corpus-oci")
    shutil.rmtree(where, ignore_errors=True)
    extract_tar(data, where)
    for flatten in (True, False):
        check_oci(where, flatten, len(data))


def replay_oci_archive(data: bytes) -> None:
    path = os.path.join(SCRATCH.name, "corpus-oci.tar")
    with open(path, "wb") as f:
        f.write(data)
    for flatten in (True, False):
        check_oci(path, flatten, len(data))


CHECKS = {
    "tar": lambda data: [check_tar(data, lenient) for lenient in (False, True)],
    "oci-directory": replay_oci_directory,
    "oci-archive": replay_oci_archive,
}


@pytest.mark.parametrize("path", [path for parser in CHECKS for path in corpus_cases(parser)],
                         ids=lambda path: f"{path.parent.name}/{path.name}")
def test_corpus(path):
    CHECKS[path.parent.name](path.read_bytes())
