"""Long, coverage-guided fuzzing runs with atheris (libFuzzer for Python), outside CI.

    .venv/bin/pip install atheris            # 3.0.0 has a wheel for CPython 3.11 on x86-64 Linux
    .venv/bin/python bench/fuzz_atheris.py TARGET [libFuzzer options] [CORPUS_DIR ...]
    .venv/bin/python bench/fuzz_atheris.py erofs -max_total_time=3600 -jobs=2 /var/tmp/erofs-corpus

Targets: erofs, pack-index, pack, chunk-read, zstd, blobmap, manifest, buildinfo, trace, prefetch-list, tar,
oci-archive.

Each input goes through the very check tests/fuzz applies (tests/fuzz/test_fuzz_parsers.py,
test_fuzz_tar.py: the parse is accepted and consistent, or raises the right DsecError, within the time and
memory bounds of tests/fuzz/fuzzlib.py), after the same fix-up the hypothesis tests apply (checksums
recomputed, counts made to agree with the length) so libFuzzer's byte mutations get past them. The
project's modules are instrumented for coverage; the harness and the tests are not.

Seeds: the first CORPUS_DIR (created if missing; libFuzzer adds what it finds there) gets the test seeds
(layers built by build_tree, PackWriter packs, traces, tars...) and tests/fuzz/corpus/TARGET; without one,
a temporary directory is used. A failing input is written, as the check saw it, to
fuzz-artifacts/TARGET/<sha256> in the current directory before libFuzzer stops: copy it to
tests/fuzz/corpus/TARGET/<what it broke>, fix the bug, and test_corpus replays it from then on.
Prints libFuzzer's own statistics; exits non-zero on a finding.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import sys
import tempfile
import tracemalloc
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "fuzz"), str(ROOT)]  # tests/fuzz first: its conftest holds the seeds

# Only the project's packages are instrumented; the test modules bring them in.
with atheris.instrument_imports(include=["dsec_fs", "erofs_builder", "lazy_fetch"]):
    import conftest
    import test_fuzz_parsers as parsers
    import test_fuzz_tar as tars
    from erofs_builder.blob import FileBlob
    from fuzzlib import corpus_cases


class _Seeds:
    """The seed layers, built on first use into a temporary directory that lives as long as the run."""

    def __init__(self):
        self._layers = None
        self._tmp = tempfile.TemporaryDirectory(prefix="dsecfs-atheris-")

    @property
    def layers(self) -> list:
        if self._layers is None:
            tmp = Path(self._tmp.name)
            self._layers = [conftest._build(tmp, "4k", conftest.seed_tree(1), 4096),
                            conftest._build(tmp, "16k", conftest.seed_tree(2), 16384)]
        return self._layers


SEEDS = _Seeds()


def _check_image(meta: bytes) -> None:
    with FileBlob(SEEDS.layers[0].blob_path) as blob:
        parsers.check_image(meta, blob)


# target -> (fix-up applied to libFuzzer's bytes, the check, the seeds)
TARGETS = {
    "erofs": (lambda data: parsers.fix_up_image(data, block_count=True), _check_image,
              lambda: [layer.meta for layer in SEEDS.layers]),
    "pack-index": (lambda data: parsers.reseal_index(data, fix_count=True), parsers.check_index,
                   lambda: parsers.INDEX_SEEDS),
    "pack": (lambda data: parsers.reseal_pack(data, fix_count=True), parsers.check_pack, lambda: parsers.PACK_SEEDS),
    "chunk-read": (lambda data: data, parsers.replay_chunk_read,
                   lambda: [struct.pack("<I", len(pack)) + pack + index for _id, pack, index, _c in parsers.PACKS]),
    "zstd": (lambda data: data, lambda data: parsers.check_decompress(data[4:], struct.unpack_from("<I", data)[0])
             if len(data) >= 4 else None,
             lambda: [struct.pack("<I", len(b"abc" * 1000)) + parsers.FRAMES[2]]),
    "blobmap": (parsers.fix_up_blobmap, parsers.check_blobmap, lambda: parsers.blobmap_seeds(SEEDS.layers)),
    "manifest": (lambda data: data, parsers.check_manifest, lambda: [layer.manifest for layer in SEEDS.layers]),
    "buildinfo": (lambda data: data, parsers.check_buildinfo, parsers.buildinfo_seeds),
    "trace": (lambda data: data, lambda data: parsers.check_trace(data, parsers.SCRATCH.name, strict=False),
              lambda: parsers.TRACE_SEEDS),
    "prefetch-list": (lambda data: data, lambda data: parsers.check_prefetch_list(data, parsers.SCRATCH.name),
                      parsers.prefetch_seeds),
    "tar": (tars.resealed_headers, lambda data: [tars.check_tar(data, lenient) for lenient in (False, True)],
            lambda: tars.TAR_SEEDS),
    "oci-archive": (tars.resealed_headers, tars.replay_oci_archive, lambda: [_oci_archive(True), _oci_archive(False)]),
}


def _oci_archive(with_index: bool) -> bytes:
    """The test image as a tar: an OCI layout (with index.json) or a docker-archive (without)."""
    docs = tars.oci_documents({}, 0)
    if not with_index:
        del docs["index.json"], docs["oci-layout"]
    members = [tars._member(name, data=data) for name, data in sorted(docs.items())]
    return tars.make_tar(members, tars.tarfile.PAX_FORMAT)


def write_seeds(target: str, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    seeds = list(TARGETS[target][2]()) + [path.read_bytes() for path in corpus_cases(target)]
    for data in seeds:
        (directory / f"seed-{hashlib.sha256(data).hexdigest()[:16]}").write_bytes(data)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(TARGETS)}}} [libFuzzer options] [CORPUS_DIR ...]")
    target = sys.argv[1]
    fix_up, check, _seeds = TARGETS[target]
    options = [arg for arg in sys.argv[2:] if arg.startswith("-")]
    corpora = [arg for arg in sys.argv[2:] if not arg.startswith("-")]
    if not corpora:
        corpora = [tempfile.mkdtemp(prefix=f"dsecfs-atheris-{target}-")]
    write_seeds(target, Path(corpora[0]))
    artifacts = Path("fuzz-artifacts") / target

    def test_one_input(data: bytes) -> None:
        data = fix_up(data)
        try:
            check(data)
        except BaseException:
            artifacts.mkdir(parents=True, exist_ok=True)
            path = artifacts / hashlib.sha256(data).hexdigest()
            path.write_bytes(data)
            print(f"\nfailing input written to {path}", file=sys.stderr)
            raise

    logging.disable(logging.WARNING)  # walk_tar's "member skipped" warnings, thousands a second
    tracemalloc.start()  # once: fuzzlib.bounded would otherwise start and stop it (and leak) per input
    atheris.Setup([sys.argv[0], *options, *corpora], test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
