"""Fixtures shared by the server tests that run the real app over a fake engine (`tests/server_helpers.py`,
`tests/server/fake_engines.py`). A test file that defines a fixture of the same name uses its own."""

import pytest
from fake_engines import LogprobEngine
from server_helpers import ServerThread, fixture_tokenizer

from server.app import create_app


@pytest.fixture(scope="module")
def tokenizer():
    return fixture_tokenizer()


@pytest.fixture
def serve(tokenizer):
    """start(script, context_length=4096, **engine kwargs) -> (server, engine): the app (no API key, served as
    "demo") over a `LogprobEngine` that answers `script`; every server started is stopped after the test."""
    servers = []

    def start(script="Hello there.", context_length=4096, **kwargs):
        engine = LogprobEngine(tokenizer, script, context_length=context_length, **kwargs)
        server = ServerThread(create_app(engine, tokenizer, served_name="demo", api_key=None,
                                         context_length=context_length))
        servers.append(server)
        return server, engine

    yield start
    for server in servers:
        server.stop()
