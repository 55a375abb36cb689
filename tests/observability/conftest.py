"""Fixtures for the observability tests."""

import socket

import pytest


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(name="free_port", scope="session")
def free_port_fixture():
    """free_port(): a loopback port free at the time of the call (for a metrics endpoint or a server)."""
    return free_port
