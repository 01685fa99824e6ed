"""Every example in README.md and docs/*.md, run as written (issue 16).

Every code block is fenced, and the first word of its info string says what this test does with it:

    sh        run: a document's sh blocks, in order, make one script (sh -eu) run in a fresh directory
    python    run with the virtualenv's python, in the same script where it stands; consecutive python
              blocks are one program (the second may use what the first defined)
    synopsis  command forms with placeholders (LAYER, [--json]): each `dsecfs ...` line names a command
              that exists, and every --option it shows is one of that command's (lines of other
              programs, such as ctr or fsck.erofs, are not checked)
    toml      parsed; with the word `dsecfs-config` after it, also loaded as a dsecfs configuration file
    text      not run: diagrams, grammars, output, the HTTP API
    console   not run: a command and its output

A block that cannot run here (a remote cluster, Kubernetes, a benchmark of many minutes) carries `no-ci`
after its language, and the paragraph just before it must say it is "not run by the tests"; the
`dsecfs` lines of an sh no-ci block are checked as a synopsis's are. An indented code block, a fence
without an info string or with one not above fails the test: no example is skipped without saying so.
New examples in any of these files are picked up as they are written.

The scripts run as root with the repository's virtualenv first on PATH, in a fresh directory below /tmp
(the daemon's socket path must stay short) holding a copy of a store that already has the Debian base
layer (built once for every document: a document's own build of it then uploads nothing). The
environment points the node's socket, state and cache directories into that directory too, as the
documents' first example does, so a document that forgot would still not touch the machine's own node.
Whatever a script leaves running or mounted is stopped and unmounted in a finally.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass

import click
import pytest

from dsec_fs.mounts import mounts_below, umount

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
DOCS = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
KINDS = {"sh", "python", "synopsis", "toml", "text", "console"}
NOT_RUN_MARKER = "not run by the tests"
FENCE = re.compile(r"^(\s*)```(.*)$")
SCRIPT_TIMEOUT = 600


@dataclass
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    kind: str
    words: list[str]  # the info string's other words
    body: str
    before: str  # the text since the previous block

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks_of(doc: str) -> list[Block]:
    """The fenced blocks of ``doc``; an indented code block or a block without a known kind fails here."""
    with open(os.path.join(REPO, doc), encoding="utf-8") as f:
        lines = f.read().split("\n")
    found, text, i = [], [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            previous_blank = i == 0 or not lines[i - 1].strip()
            code_indent = " " * (6 if _in_list(lines, i) else 4)
            if lines[i].startswith(code_indent) and lines[i].strip() and previous_blank:
                raise AssertionError(f"{doc}:{i + 1}: an indented code block; fence it with an info string")
            text.append(lines[i])
            i += 1
            continue
        indent, info = fence[1], fence[2].split()
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        assert i < len(lines), f"{doc}:{start + 1}: a fence that is never closed"
        assert info and info[0] in KINDS, f"{doc}:{start + 1}: info string {' '.join(info)!r}: give one of {sorted(KINDS)}"
        found.append(Block(doc, start + 1, info[0], info[1:], "\n".join(body) + "\n", "\n".join(text)))
        text = []
        i += 1
    return found


def _in_list(lines: list[str], i: int) -> bool:
    """Whether line ``i`` continues a list item (a paragraph indented under `- ` or `1. `)."""
    for line in reversed(lines[:i]):
        if line.strip() and not line.startswith(" "):
            return bool(re.match(r"(- |\d+\. )", line))
    return False


def all_blocks() -> list[Block]:
    return [block for doc in DOCS for block in blocks_of(doc)]


def test_every_code_block_says_what_it_is_and_not_run_ones_say_why():
    blocks = all_blocks()
    assert {b.kind for b in blocks} >= {"sh", "python", "synopsis", "toml", "text"}
    for block in blocks:
        if "no-ci" in block.words:
            paragraph = block.before.strip().split("\n\n")[-1]
            assert NOT_RUN_MARKER in " ".join(paragraph.split()), f"{block.where}: say it is {NOT_RUN_MARKER!r}"


def test_toml_examples_parse_and_configuration_examples_load():
    from cli.config import load_default_map
    from cli.main import main

    blocks = [b for b in all_blocks() if b.kind == "toml"]
    assert any("dsecfs-config" in b.words for b in blocks)
    for block in blocks:
        tomllib.loads(block.body)  # raises naming the line
        if "dsecfs-config" in block.words:
            with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
                f.write(block.body)
                f.flush()
                assert load_default_map(main, f.name), block.where


def _command_lines(body: str) -> list[str]:
    """The `dsecfs ...` commands of a synopsis block: continuation lines joined, comments dropped, a line
    cut at ` ; ` and ` | `."""
    commands = []
    for line in re.sub(r"\\\n\s*", " ", body).split("\n"):
        code = re.split(r"\s#\s", " " + line, maxsplit=1)[0]
        commands += [part.strip() for part in re.split(r"\s;\s|\s\|\s", code) if part.strip().startswith("dsecfs ")]
    return commands


def test_synopsis_lines_name_real_commands_and_options():
    from cli.main import main

    checked = 0
    for block in (b for b in all_blocks() if b.kind == "synopsis" or "no-ci" in b.words and b.kind == "sh"):
        for line in _command_lines(block.body):
            command, words = main, line.split()[1:]
            while isinstance(command, click.Group) and words and words[0] in command.commands:
                command, words = command.commands[words.pop(0)], words
            assert not isinstance(command, click.Group), f"{block.where}: {line!r}: no such command"
            known = {opt for param in command.params for opt in param.opts + param.secondary_opts} | {"--help"}
            for word in words:
                if word == "--":  # the command to run in the sandbox or the export follows
                    break
                for option in re.findall(r"^\[?(--?[a-zA-Z][\w-]*)", word):
                    assert option in known, f"{block.where}: {command.name} has no option {option}: {line!r}"
            checked += 1
    assert checked > 40


# ---- running the examples ----------------------------------------------------------------------------


PY_END = "DSECFS_EXAMPLE_PY"


def script_of(doc: str) -> str | None:
    """The document's sh and python blocks as one sh script, each block announced on stderr."""
    parts, python = [], []
    runnable = [b for b in blocks_of(doc) if b.kind in ("sh", "python") and "no-ci" not in b.words]
    if not runnable:
        return None
    for block in runnable:
        if block.kind == "python":
            python.append(block)
            continue
        parts += _python_part(python)
        python = []
        parts.append(f"echo '### {block.where}' >&2\n{block.body}")
    parts += _python_part(python)
    return "set -eu\n" + "\n".join(parts)


def _python_part(blocks: list[Block]) -> list[str]:
    if not blocks:
        return []
    where = ", ".join(b.where for b in blocks)
    program = "\n".join(b.body for b in blocks)
    assert PY_END not in program
    return [f"echo '### {where}' >&2\n\"$PYTHON\" - <<'{PY_END}'\n{program}{PY_END}"]


def _runnable_docs() -> list[str]:
    try:
        return [doc for doc in DOCS if script_of(doc)]
    except AssertionError:  # a malformed block: every document's run fails, naming it
        return DOCS


RUNNABLE_DOCS = _runnable_docs()


@pytest.fixture(scope="module")
def seed_store(debian_rootfs, tmp_path_factory) -> str:
    """A store holding the Debian base layer, built once for every document."""
    store = str(tmp_path_factory.mktemp("docs-seed") / "store")
    subprocess.run([os.path.join(BIN, "dsecfs"), "build", debian_rootfs, "--store", store, "--name",
                    "base/debian:12", "-q"], check=True, capture_output=True, timeout=300)
    return store


def _daemon_pid(env: dict) -> int | None:
    done = subprocess.run([os.path.join(BIN, "dsecfs"), "status", "--json"], env=env, capture_output=True,
                          text=True, timeout=30)
    return json.loads(done.stdout)["pid"] if done.returncode == 0 else None


def _stop(pid: int, timeout: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _clean_up(work: str, env: dict, script: subprocess.Popen | None) -> None:
    """Take down what the examples left: sandboxes, the daemon (which unmounts its layers), the script's
    own processes, then any mount below ``work``."""
    try:
        listed = subprocess.run([os.path.join(BIN, "dsecfs"), "sandbox", "ls", "--json"], env=env,
                                capture_output=True, text=True, timeout=60)
        if listed.returncode == 0:
            for sandbox in json.loads(listed.stdout).get("sandboxes", []):
                subprocess.run([os.path.join(BIN, "dsecfs"), "sandbox", "down", sandbox["id"], "-q"], env=env,
                               capture_output=True, timeout=60)
        pid = _daemon_pid(env)
        if pid is not None:
            _stop(pid, 30)
    finally:
        if script is not None:
            try:
                os.killpg(script.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            script.wait()
        for target in sorted(mounts_below(work), key=len, reverse=True):
            try:
                umount(target, lazy=True)
            except Exception:
                pass


@pytest.mark.root
@pytest.mark.fuse
@pytest.mark.slow
@pytest.mark.parametrize("doc", RUNNABLE_DOCS)
def test_the_examples_run_as_written(doc, seed_store, moto_server):
    work = tempfile.mkdtemp(prefix="dsx-", dir="/tmp")  # short: the daemon's socket is in it
    env = {name: value for name, value in os.environ.items()
           if name not in ("DSECFS_CONFIG", "PYTHONPATH", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3")}
    env.update(moto_server.env())  # S3 examples: the documented environment points boto3 at the moto server
    env.update({"PATH": f"{BIN}:{os.environ['PATH']}", "PYTHON": sys.executable,
                "DSECFS_STORE": f"{work}/store", "DSECFS_SOCKET": f"{work}/daemon.sock",
                "DSECFS_STATE_DIR": f"{work}/state", "DSECFS_CACHE_DIR": f"{work}/cache"})
    script = None
    try:
        shutil.copytree(seed_store, f"{work}/store", symlinks=True)
        with open(f"{work}/example.sh", "w") as f:
            f.write(script_of(doc))
        with open(f"{work}/stdout", "w+b") as out, open(f"{work}/stderr", "w+b") as err:
            # Files, not pipes: a daemon the examples start in the background keeps what it inherited open.
            script = subprocess.Popen(["sh", f"{work}/example.sh"], cwd=work, env=env, stdin=subprocess.DEVNULL,
                                      stdout=out, stderr=err, start_new_session=True)
            code = script.wait(timeout=SCRIPT_TIMEOUT)
            out.seek(0), err.seek(0)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        started = re.findall(r"^### (.+)$", stderr, re.M)
        assert code == 0, (f"the example at {started[-1] if started else doc} exited {code}\n"
                           f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}")
        assert started == re.findall(r"^echo '### (.+)' >&2$", script_of(doc), re.M)  # every block ran
    finally:
        _clean_up(work, env, script)
        assert mounts_below(work) == []
        shutil.rmtree(work, ignore_errors=True)
