"""The drafter link's writes (verifier_service/drafter_link.py): over the same-host stream a
request alone's commit leaves when it is told, before the round's event; in a batch a task
writes it, so that a step's commits reach the drafter together (DESIGN §9)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile

import pytest

from shared.local_stream import MESSAGE, METADATA
from shared.protocol import drafter_pb2
from verifier_service.drafter_link import DeadlineTracker, DrafterLink, LocalDrafterStub
from verifier_service.settings import VerifierSettings


@pytest.fixture
def drafter_socket():
    """A bare listening Unix socket in the drafter's place: it reads what reached it, no event loop."""
    directory = tempfile.mkdtemp(prefix="tandem-dl-")  # (short: a Unix socket path is at most 107 bytes)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{directory}/d.sock")
    listener.listen(1)
    yield listener
    listener.close()
    shutil.rmtree(directory, ignore_errors=True)


async def opened(listener: socket.socket) -> tuple[DrafterLink, socket.socket]:
    """A link opened on the bare socket, and the socket's end of its stream."""
    link = DrafterLink(LocalDrafterStub(listener.getsockname(), 1 << 20), DeadlineTracker(VerifierSettings()))
    await link.open(drafter_pb2.DraftOpen(session_id="s", token_ids=[1, 2, 3]))
    conn, _ = listener.accept()
    conn.settimeout(5)
    return link, conn


def commit(round_id: int) -> drafter_pb2.DraftCommit:
    return drafter_pb2.DraftCommit(round_id=round_id, num_accepted=1, emitted_token_ids=[5, 6], num_verified=2)


async def test_a_commit_at_once_over_the_local_stream_is_written_when_told(drafter_socket, frames_on):
    link, conn = await opened(drafter_socket)
    await link.commit(commit(0), at_once=True)  # (a coroutine that does not suspend: no other task runs meanwhile)
    await link.commit(commit(1), at_once=True)
    assert link.sending is None  # no write left pending in a task
    frames = frames_on(conn, 4)  # the metadata, the open, both commits: on the socket before any await
    assert [kind for kind, _ in frames] == [METADATA, MESSAGE, MESSAGE, MESSAGE]
    ups = [drafter_pb2.DraftUp.FromString(payload) for _, payload in frames[1:]]
    assert ups[0].WhichOneof("kind") == "open" and [up.commit.round_id for up in ups[1:]] == [0, 1]
    assert ups[1].commit.wait_ms > 0 and list(ups[2].commit.emitted_token_ids) == [5, 6]
    await link.close()
    conn.close()


async def test_a_commit_behind_a_pending_write_waits_for_it(drafter_socket, frames_on):
    link, conn = await opened(drafter_socket)
    assert len(frames_on(conn, 2)) == 2  # the metadata and the open
    earlier = asyncio.get_running_loop().create_future()
    link.sending = asyncio.ensure_future(earlier)  # an earlier write, not yet done
    await link.commit(commit(0), at_once=True)
    await asyncio.sleep(0.05)
    conn.settimeout(0.05)
    with pytest.raises(TimeoutError):  # not written past the pending one
        conn.recv(1)
    earlier.set_result(None)
    await link.flush()
    conn.settimeout(5)
    assert drafter_pb2.DraftUp.FromString(frames_on(conn, 1)[0][1]).commit.round_id == 0
    await link.close()
    conn.close()


async def test_in_a_batch_commits_leave_together_in_a_task(drafter_socket, frames_on):
    link, conn = await opened(drafter_socket)
    assert len(frames_on(conn, 2)) == 2  # the metadata and the open
    await link.commit(commit(0))
    assert link.sending is not None and not link.sending.done()  # not written yet: a task will
    await link.flush()
    assert drafter_pb2.DraftUp.FromString(frames_on(conn, 1)[0][1]).commit.round_id == 0
    await link.close()
    conn.close()
