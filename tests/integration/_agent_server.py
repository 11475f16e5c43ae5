"""The agent-proxy tests' one embedded server on the tiny agent model (module-scoped fixtures shared by
test_agent_proxy.py and test_agent_proxy_bounds.py; `engine_servers` is conftest's)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def agent_model_dir(tmp_path_factory):
    from areal_like.data.tiny_model import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("agent_model") / "model"), agent=True)


@pytest.fixture(scope="module")
def server(engine_servers, agent_model_dir):
    (srv,) = engine_servers(agent_model_dir, 1, "--max-context-len", "512")
    return srv
