"""IdleMounts (lazy_fetch/idle_mounts.py) on trio's mock clock: a parked mount goes when its grace ends,
not before; one taken meanwhile stays; grace 0 parks nothing; the stop unmounts every idle mount and
parks no more; a failing unmount is logged and the others still go."""

from __future__ import annotations

import trio
import trio.testing

from dsec_fs.errors import UnavailableError
from lazy_fetch.idle_mounts import IdleMounts


def run(test) -> None:
    trio.run(test, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_parked_mount_goes_when_its_grace_ends_unless_taken():
    async def main():
        idle = IdleMounts(grace=10.0)
        gone: list[tuple[str, float]] = []

        def unmount(name):
            async def go():
                gone.append((name, trio.current_time()))
            return go

        async with trio.open_nursery() as nursery:
            nursery.start_soon(idle.run)
            start = trio.current_time()
            assert idle.park("/a", unmount("/a")) and idle.until("/a")
            await trio.sleep(4)
            assert idle.park("/b", unmount("/b"))
            await trio.sleep(5)
            assert gone == [] and len(idle) == 2
            assert idle.take("/b") and not idle.take("/b") and idle.until("/b") == ""
            await trio.sleep(1.5)
            assert [name for name, _ in gone] == ["/a"] and gone[0][1] - start == 10.0
            await trio.sleep(60)
            assert [name for name, _ in gone] == ["/a"] and len(idle) == 0  # /b was taken: it stays
            nursery.cancel_scope.cancel()

    run(main)


def test_grace_zero_parks_nothing_and_the_stop_unmounts_all():
    async def main():
        assert not IdleMounts(grace=0).park("/a", None)
        idle = IdleMounts(grace=3600)
        gone = []

        async def fails():
            raise UnavailableError("busy", where="/bad")

        def unmount(name):
            async def go():
                gone.append(name)
            return go

        idle.park("/a", unmount("/a"))
        idle.park("/bad", fails)
        idle.park("/c", unmount("/c"))
        await idle.unmount_all()
        assert gone == ["/a", "/c"] and len(idle) == 0
        assert not idle.park("/d", unmount("/d"))  # stopping: the caller unmounts at once

    run(main)
