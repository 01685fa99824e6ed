"""What every fuzz test shares: hypothesis settings, the byte-mutation strategy, time and memory bounds, and
the corpus of inputs that once broke a parser.

Budget. By default each property runs a fixed, derandomized set of examples (the same every run, so CI is
reproducible and the whole directory stays well under a minute). ``DSECFS_FUZZ_EXAMPLES=20000`` runs that
many examples per property instead, randomized, for long runs; hypothesis prints the seed and the
reproducing blob of any failure (``--hypothesis-seed=N`` replays a run).

Bounds. ``bounded`` runs one parse under a wall-clock alarm (``Hang`` if it runs too long: a loop that
does not end, or work far out of proportion to the input) and tracemalloc (the peak must stay under a
base plus a multiple of the input's size, so a length read from the input and used as an allocation size
is caught even when the allocation itself would succeed).

Corpus. ``corpus/<parser>/<name>`` holds each input that ever broke something; ``corpus_cases(parser)``
lists them for a replay test. ``save_to_corpus`` is for a person at a debugger: hypothesis shrinks a
failure, you store the shrunk input under a name saying what it broke.
"""

from __future__ import annotations

import json
import os
import re
import signal
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from dsec_fs.errors import DsecError, FormatError

EXAMPLES_ENV = "DSECFS_FUZZ_EXAMPLES"
LONG_RUN_EXAMPLES = int(os.environ.get(EXAMPLES_ENV, "0") or 0)
CORPUS = Path(__file__).parent / "corpus"

# One example parses a few KiB to a few hundred KiB: a second is already far too long.
EXAMPLE_SECONDS = 10.0
MEMORY_BASE = 32 << 20  # interpreter noise, caches, one decompressed chunk
MEMORY_PER_INPUT_BYTE = 64  # parsed structures may be bigger than their bytes, but not by much more


def fuzz_settings(examples: int) -> settings:
    """``examples`` derandomized examples, or $DSECFS_FUZZ_EXAMPLES random ones."""
    return settings(
        max_examples=LONG_RUN_EXAMPLES or examples,
        derandomize=not LONG_RUN_EXAMPLES,
        deadline=None,  # the alarm in ``bounded`` is the time bound; hypothesis deadlines flake on a busy box
        database=None,  # failures are kept in corpus/ by hand, not in a local database
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                               HealthCheck.function_scoped_fixture],
    )


# ---------------------------------------------------------------------------------------------------------
# Time and memory.


class Hang(Exception):
    """An example ran past EXAMPLE_SECONDS. An Exception (not a BaseException, which hypothesis would let
    through without shrinking or reporting the example); the code under test catches only its own errors."""


def bounded(parse: Callable[[], object], *, allowed: type[BaseException] | tuple[type[BaseException], ...],
            input_size: int, seconds: float = EXAMPLE_SECONDS, memory: int | None = None) -> object:
    """``parse()``'s result, or the ``allowed`` error it raised (returned, not raised). Any other exception
    propagates and fails the example; so does running longer than ``seconds`` (Hang) or a tracemalloc peak
    above ``memory`` (default: MEMORY_BASE + MEMORY_PER_INPUT_BYTE x ``input_size``)."""
    limit = memory if memory is not None else MEMORY_BASE + MEMORY_PER_INPUT_BYTE * input_size

    def alarm(_signum, _frame):
        raise Hang(f"the parse ran longer than {seconds} s on a {input_size}-byte input")

    # Tracing everything else (hypothesis's generation too) would slow the tests several times, so it runs
    # for the parse only, unless the caller keeps it on: starting and stopping it leaks a little memory
    # each time, which a run of millions of inputs (bench/fuzz_atheris.py) would notice.
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    before, _peak = tracemalloc.get_traced_memory()
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        try:
            outcome = parse()
        except allowed as exc:
            outcome = exc
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _current, peak = tracemalloc.get_traced_memory()
        if started:
            tracemalloc.stop()
    used = peak - before
    assert used <= limit, f"a {input_size}-byte input made the parse allocate {used:,} bytes (limit {limit:,})"
    return outcome



def note(outcome: object) -> None:
    """Count how far an input got, for --hypothesis-show-statistics: accepted, or which error (with the
    structure a FormatError names). Corpus replays run outside hypothesis, where there is nothing to count."""
    if not currently_in_test_context():
        return
    if isinstance(outcome, str):
        event(outcome)
    elif isinstance(outcome, FormatError):
        event(f"FormatError: {re.sub(r'[0-9]+', 'N', outcome.structure)}")
    elif isinstance(outcome, DsecError):
        event(f"{type(outcome).__name__}: {re.sub(r'[0-9]+', 'N', outcome.message[:40])}")
    else:
        event("accepted")


# ---------------------------------------------------------------------------------------------------------
# Mutations of valid encodings.

# Values that sit on the edges parsers get wrong: zero, one, sign bits, all ones, block and page sizes.
INTERESTING = (0, 1, 2, 7, 8, 12, 31, 32, 40, 63, 64, 127, 128, 255, 256, 511, 512, 1023, 1024, 4095, 4096,
               4097, 0x7FFF, 0x8000, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 32, 1 << 40,
               (1 << 63) - 1, 1 << 63, (1 << 64) - 1)


# Changes that keep the length (and so every offset behind them) come twice as often; truncation, which
# ends most parses at once, is the rarest.
OPS = ("flip", "flip", "value", "value", "overwrite", "overwrite", "insert", "delete", "truncate", "splice",
       "splice", "repeat")


@st.composite
def _mutate_once(draw, data: bytearray, seeds: Sequence[bytes], start: int) -> bytearray:
    size = len(data)
    # Hypothesis favours small integers, so positions count from ``start``: where the structures begin.
    low = start if start < size else 0
    pos = low + draw(st.integers(0, max(size - 1 - low, 0)), label="position")
    op = draw(st.sampled_from(OPS), label="op")
    if op == "flip" and size:
        data[pos] ^= draw(st.integers(1, 255), label="xor")
    elif op == "value" and size:
        width = draw(st.sampled_from([1, 2, 4, 8]), label="width")
        value = draw(st.sampled_from(INTERESTING), label="value") % (1 << (8 * width))
        if draw(st.booleans(), label="nearby"):
            value = (value + draw(st.integers(-2, 2))) % (1 << (8 * width))
        data[pos:pos + width] = value.to_bytes(width, "little")
    elif op == "overwrite" and size:
        piece = draw(st.binary(min_size=1, max_size=16), label="bytes")
        data[pos:pos + len(piece)] = piece
    elif op == "insert":
        data[pos:pos] = draw(st.binary(min_size=1, max_size=64), label="bytes")
    elif op == "delete" and size:
        del data[pos:pos + draw(st.integers(1, max(1, size // 4)), label="length")]
    elif op == "truncate":
        del data[pos:]
    elif op in ("splice", "repeat") and size:
        # A piece of a seed (this one for "repeat") copied over or into another place: real structure in
        # the wrong place, which flips and random bytes rarely produce.
        donor = data if op == "repeat" else draw(st.sampled_from(list(seeds)), label="donor")
        if donor:
            start = draw(st.integers(0, len(donor) - 1), label="from")
            piece = bytes(donor[start:start + draw(st.integers(1, 256), label="length")])
            if draw(st.booleans(), label="insert"):
                data[pos:pos] = piece
            else:
                data[pos:pos + len(piece)] = piece
    return data


@st.composite
def mutations(draw, seeds: Sequence[bytes], *, max_ops: int = 6, start: int = 0) -> bytes:
    """One of ``seeds`` after 1..max_ops flips, edge values, insertions, deletions, truncations and splices,
    at positions from ``start`` on (where the input has a fixed preamble, such as EROFS's boot area)."""
    data = bytearray(draw(st.sampled_from(list(seeds)), label="seed"))
    for _ in range(draw(st.integers(1, max_ops), label="ops")):
        data = draw(_mutate_once(data, seeds, start))
    return bytes(data)


def inputs(seeds: Sequence[bytes], *, max_ops: int = 6, max_random: int = 4096) -> st.SearchStrategy[bytes]:
    """Mostly structure-aware mutations of ``seeds``; sometimes arbitrary bytes, or a seed's first bytes
    (its magic) followed by arbitrary bytes."""
    prefixed = st.tuples(st.sampled_from(list(seeds)), st.integers(1, 64), st.binary(max_size=max_random)).map(
        lambda t: t[0][:t[1]] + t[2])
    return st.one_of(mutations(seeds, max_ops=max_ops), mutations(seeds, max_ops=max_ops),
                     mutations(seeds, max_ops=max_ops), st.binary(max_size=max_random), prefixed)


# ---------------------------------------------------------------------------------------------------------
# Mutations of JSON documents.

_EDGE_STRINGS = ["", "0" * 64, "a" * 64, "sha256:" + "0" * 64, "2024-01-01T00:00:00Z", "2024-01-01T00:00:00+01:00",
                 "../x", "/abs", "a\u0000b", "\udcff", "x" * 5000]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40) | st.sampled_from(_EDGE_STRINGS),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
_DEEP = "DSECFS-FUZZ-DEEP"  # stands for a value nested too deep to build as Python objects
DEEP_DEPTH = 5000  # far past the json module's recursion limit


def _slots(doc, out: list) -> list:
    """(container, key) of every value in a JSON document, containers included."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        out.append((doc, key))
        _slots(value, out)
    return out


@st.composite
def json_mutations(draw, seeds: Sequence[bytes], *, max_edits: int = 3) -> bytes:
    """A seed document (bytes of JSON) with 1..max_edits values anywhere in it removed, replaced by any
    JSON value, or replaced by a value nested DEEP_DEPTH levels deep; keys may be added too."""
    doc = json.loads(draw(st.sampled_from(list(seeds)), label="seed"))
    deep = False
    for _ in range(draw(st.integers(1, max_edits), label="edits")):
        slots = _slots(doc, [])
        if not slots:
            doc = draw(JSON_VALUES, label="document")
            continue
        container, key = draw(st.sampled_from(slots), label="slot")
        edit = draw(st.sampled_from(["replace", "replace", "remove", "add", "deep"]), label="edit")
        if edit == "remove":
            del container[key]
        elif edit == "add" and isinstance(container, dict):
            container[draw(st.text(max_size=10), label="key")] = draw(JSON_VALUES, label="value")
        elif edit == "deep":
            container[key], deep = _DEEP, True
        else:
            container[key] = draw(JSON_VALUES, label="value")
    text = json.dumps(doc)
    if deep:
        text = text.replace(f'"{_DEEP}"', "[" * DEEP_DEPTH + "]" * DEEP_DEPTH)
    return text.encode()


# ---------------------------------------------------------------------------------------------------------
# The corpus.


def corpus_cases(parser: str) -> list[Path]:
    directory = CORPUS / parser
    return sorted(p for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []


def save_to_corpus(parser: str, name: str, data: bytes) -> Path:
    """Keep an input that broke ``parser`` (call it by hand on a shrunk failure)."""
    path = CORPUS / parser / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
