"""``sandbox commit`` against a hostile sandbox: a process inside racing the walk of its upper dir, and
setuid files and device nodes made inside (issue 14). Real runc, kernel EROFS and OverlayFS; the
sandbox's helper is Debian's perl calling renameat2(2) itself.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest
from click.testing import CliRunner

from dsec_fs.errors import InputError
from erofs_builder.build import build_tree
from cli.main import main as dsecfs
from erofs_builder.export import extract_layer
from erofs_builder.limits import LayerLimits
from overlay.sandbox import SandboxSpec
from tests.overlay.support import build_programs

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("nothing_left_mounted")]

# In-image path -> path in the Debian rootfs (x86_64): /bin/sh and perl.
PERL_FILES = {
    "bin/sh": "usr/bin/dash", "bin/perl": "usr/bin/perl",
    "lib64/ld-linux-x86-64.so.2": "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
    **{f"lib/x86_64-linux-gnu/{lib}": f"usr/lib/x86_64-linux-gnu/{lib}"
       for lib in ("libc.so.6", "libm.so.6", "libcrypt.so.1")},
}
COMMITS = 100
SYS_RENAMEAT2, SYS_MKNOD = 316, 133  # x86_64
# A setuid-root copy of /bin/sh, a setgid one, a 0666 /dev/mem (1:1), a whiteout (a base file removed).
PRIVILEGED = f"""
open(my $in, "<", "/bin/sh") or die; binmode $in; local $/; my $sh = <$in>; close $in;
for my $name ("rootsh", "groupsh") {{ open(my $out, ">", "/$name") or die; binmode $out; print $out $sh; close $out }}
chmod 04755, "/rootsh" or die; chmod 02755, "/groupsh" or die;
my $mem = "/mem";
syscall({SYS_MKNOD}, $mem, 0020666, 257) == 0 or die "mknod: $!";
unlink "/etc/os-release" or die;
"""
PAIRS = 1  # more pairs make more walks see a replaced entry and refuse, and fewer reach the host file
# Makes /work/d<i> (directories of the upper dir, each holding a file "secret") and /work/l<i> (symlinks to
# the host directory given as $ARGV[0]).
SETUP = f"""
mkdir "/work" or die;
for my $i (0 .. {PAIRS - 1}) {{
    mkdir "/work/d$i" or die; open(my $f, ">", "/work/d$i/secret") or die; print $f "sandbox"; close $f;
    symlink($ARGV[0], "/work/l$i") or die;
}}
"""
# Swaps each /work/d<i> with /work/l<i> (RENAME_EXCHANGE) over and over until /stop appears, and prints
# how many swaps it made.
SWAPPER = f"""
open(my $f, ">", "/started") or die; close $f;
my ($n, $end) = (0, time + 120);
my @pairs = map {{ ["/work/d$_", "/work/l$_"] }} 0 .. {PAIRS - 1};
while (!-e "/stop" && time < $end) {{
    for (1 .. 100) {{
        for my $p (@pairs) {{ syscall({SYS_RENAMEAT2}, -100, $p->[0], -100, $p->[1], 2) == 0 or die "$!"; $n++ }}
    }}
}}
print "$n\n";
"""


@pytest.fixture
def perl_base(store, tmp_path, debian_rootfs):
    return build_programs(store, tmp_path, debian_rootfs, "base/perl:1", PERL_FILES, {"etc/os-release": b"ID=perl\n"})


@pytest.mark.parametrize("runtime", ["namespaces", "runc"])
def test_a_sandbox_swapping_a_directory_for_a_symlink_during_commit_publishes_no_host_file(
        manager, store, tmp_path, perl_base, runtime):
    """With the namespaces runtime nothing freezes the swapper: the walk alone must hold (a commit may be
    refused, never leak). runc containers are frozen for the commit: every commit goes through."""
    secret = b"HOST-ONLY-" + secrets.token_hex(16).encode()
    host_dir = tmp_path / "host"
    host_dir.mkdir(mode=0o700)
    with open(host_dir / "secret", "wb") as f:
        f.write(secret)
    os.chmod(host_dir / "secret", 0o600)
    state = manager.up(SandboxSpec(base=perl_base, name="racer"))
    assert manager.exec("racer", ["/bin/perl", "-e", SETUP, str(host_dir)], runtime=runtime).exit_code == 0

    outcomes = {"built": 0, "refused": 0}
    with ThreadPoolExecutor(1) as pool:
        swapper = pool.submit(manager.exec, "racer", ["/bin/perl", "-e", SWAPPER], runtime=runtime)
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(os.path.join(state.rootfs, "started")):
                assert time.monotonic() < deadline and not swapper.done(), swapper.result() if swapper.done() else ""
                time.sleep(0.01)
            for run in range(COMMITS):
                try:
                    manager.commit("racer", lambda tree: build_tree(tree, store, name=f"ws/racer:{run}"))
                except InputError:  # the walk saw an entry replaced: refused, nothing published
                    outcomes["refused"] += 1
                    continue
                out = tmp_path / f"extract-{run}"
                extract_layer(store, f"ws/racer:{run}", out)
                for directory, _dirs, names in os.walk(out):
                    for name in names:
                        path = os.path.join(directory, name)
                        if not os.path.islink(path):
                            with open(path, "rb") as f:
                                assert secret not in f.read(), f"run {run}: a host file is in the layer at {path}"
                outcomes["built"] += 1
        finally:
            open(os.path.join(state.rootfs, "stop"), "wb").close()
            result = swapper.result()
    assert result.exit_code == 0, result.stderr
    assert int(result.stdout) > COMMITS  # the swaps really ran all along
    assert outcomes["built"] + outcomes["refused"] == COMMITS
    assert outcomes["built"] > 0  # commits between swaps still go through
    if runtime == "runc":
        assert outcomes["refused"] == 0, outcomes  # the swapper was frozen for every commit


def test_commit_and_extract_leave_out_setuid_files_and_devices_made_in_a_sandbox(manager, store, tmp_path,
                                                                                perl_base):
    manager.up(SandboxSpec(base=perl_base, name="priv"))
    result = manager.exec("priv", ["/bin/perl", "-e", PRIVILEGED])
    assert result.exit_code == 0, result.stderr

    commit = manager.commit("priv")
    assert commit.dropped.to_dict() == {"setuid": 1, "setgid": 1, "devices": 1, "capabilities": 0}
    build_tree(commit.tree, store, name="ws/priv:1")
    out = tmp_path / "out"
    run = CliRunner().invoke(dsecfs, ["extract", "ws/priv:1", str(out), "--store", store.url])
    assert run.exit_code == 0, run.output
    assert stat.S_IMODE(os.stat(out / "rootsh").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(out / "groupsh").st_mode) == 0o755
    assert not os.path.lexists(out / "mem")
    whiteout = os.lstat(out / "etc" / "os-release")  # the deletion is still in the layer
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0

    # --keep-privileged, on both sides, keeps all of it (the layer was built by its owner, say).
    kept = manager.commit("priv", keep_privileged=True)
    assert kept.dropped.total() == 0
    build_tree(kept.tree, store, name="ws/priv:2")
    run = CliRunner().invoke(dsecfs, ["extract", "ws/priv:2", str(tmp_path / "default"), "--store", store.url])
    assert run.exit_code == 0 and "1 setuid, 1 setgid, 1 devices" in run.output  # extract as root drops them
    assert not os.stat(tmp_path / "default" / "rootsh").st_mode & stat.S_ISUID
    run = CliRunner().invoke(dsecfs, ["extract", "ws/priv:2", str(tmp_path / "all"), "--store", store.url,
                                      "--keep-privileged"])
    assert run.exit_code == 0, run.output
    st = os.stat(tmp_path / "all" / "rootsh")
    assert st.st_uid == 0 and st.st_mode & stat.S_ISUID
    mem = os.lstat(tmp_path / "all" / "mem")
    assert stat.S_ISCHR(mem.st_mode) and mem.st_rdev == os.makedev(1, 1)


# Makes $ARGV[0] directories /many/d<k> of $ARGV[1] empty files each, and /flat of $ARGV[2].
MANY_NAMES = """
mkdir "/many" or die; mkdir "/flat" or die;
for my $k (1 .. $ARGV[0]) { mkdir "/many/d$k" or die;
    for my $i (1 .. $ARGV[1]) { open(my $f, ">", "/many/d$k/$i") or die; close $f } }
for my $i (1 .. $ARGV[2]) { open(my $f, ">", "/flat/$i") or die; close $f }
"""

# Removes the trees named in @ARGV (the perl of the image has no modules).
REMOVE_TREES = """
sub rm { my $p = shift; if (-d $p) { opendir(my $h, $p) or die; my @e = grep { $_ ne "." && $_ ne ".." } readdir $h;
    closedir $h; rm("$p/$_") for @e; rmdir $p or die } else { unlink $p or die } }
rm($_) for @ARGV;
"""


def test_a_sandbox_making_millions_of_names_is_refused_at_commit_before_its_walk_holds_them(manager, store,
                                                                                           perl_base):
    """A sandbox's process makes names without end in its upper dir (here 200,000 empty files, in many
    small directories and one big one); the commit, whose walk runs in the daemon's memory, must stop at the
    layer's bound, not hold every name first (before: about 1 KB each, the whole upper, then refused)."""
    manager.up(SandboxSpec(base=perl_base, name="names"))
    result = manager.exec("names", ["/bin/perl", "-e", MANY_NAMES, "20", "5000", "100000"])
    assert result.exit_code == 0, result.stderr
    bound = LayerLimits(max_meta_size=1 << 20)  # about 12,000 names
    upper = manager.get("names").upper
    for made in ("many", "flat"):  # names spread over directories; one directory listed past the bound
        os.rename(os.path.join(upper, made), os.path.join(upper, "a" + made))  # the walk meets it first
        tracemalloc.start()
        try:
            with pytest.raises(InputError, match="--max-meta-size") as refused:
                manager.commit("names", lambda tree: build_tree(tree, store, name="ws/names:1", limits=bound),
                               limits=bound)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 24 << 20, f"{made}: the walk held {peak >> 20} MiB"
        assert refused.value.where.startswith(os.path.join(upper, "a" + made))
        os.rename(os.path.join(upper, "a" + made), os.path.join(upper, made))
    removed = manager.exec("names", ["/bin/perl", "-e", REMOVE_TREES, "/many", "/flat"])
    assert removed.exit_code == 0, removed.stderr
    committed = manager.commit("names", lambda tree: build_tree(tree, store, name="ws/names:1", limits=bound),
                               limits=bound)
    assert committed.published.digest
