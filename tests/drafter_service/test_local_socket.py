"""The drafter's Draft streams on its Unix socket (--local-socket): started and removed with the
service, refused while it drains, and a path it cannot bind named at start-up."""

import os
import shutil
import tempfile

import grpc
import pytest

from drafter_service.server import DrafterServer
from drafter_service.settings import DrafterSettings
from shared.local_stream import LocalCall
from shared.protocol import drafter_pb2
from shared.service import StartupError


@pytest.fixture
def socket_dir():
    directory = tempfile.mkdtemp(prefix="tandem-ds-")  # (short: a Unix socket path is at most 107 bytes)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


async def test_the_socket_lives_with_the_service_and_drain_refuses_new_streams(tiny_mtp_model, socket_dir, open_up):
    path = f"{socket_dir}/d.sock"
    server = DrafterServer(DrafterSettings(port=0, local_socket=path), model=tiny_mtp_model)
    await server.start()
    try:
        await server.wait_loaded()
        stream = LocalCall(path, drafter_pb2.DraftDown, (), 1 << 20)
        await stream.write(open_up(tiny_mtp_model, [5, 17, 42, 8]))
        first = await anext(aiter(stream))
        assert first.chain.round_id == 0  # the open's chain, over the socket
        stream.cancel()
        server.begin_drain(0.0)
        late = LocalCall(path, drafter_pb2.DraftDown, (), 1 << 20)
        await late.write(open_up(tiny_mtp_model, [5, 17, 42, 8]))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await anext(aiter(late))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in error.value.details()
    finally:
        await server.stop(0)
    assert not os.path.exists(path)


async def test_a_path_it_cannot_bind_is_a_startup_error_naming_the_setting(tiny_mtp_model, socket_dir):
    path = f"{socket_dir}/missing/d.sock"
    server = DrafterServer(DrafterSettings(port=0, local_socket=path), model=tiny_mtp_model)
    with pytest.raises(StartupError, match=f"local_socket = {path}"):
        await server.start()
