"""Shared by the training tests: this process as rank 0 of a torchrun world of one."""

import contextlib
import socket

import pytest

from lmforge.train.parallel import cleanup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _world_of_one():
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        try:
            yield
        finally:
            cleanup()


@pytest.fixture(scope="session")
def world_of_one():
    """A context manager: inside it, this process is rank 0 of a torchrun world of size 1 (the
    distributed code path: process group, lanes, sharded checkpoints), torn down on exit."""
    return _world_of_one
