"""Clients of the module's `server` fixture (a ServerProcess each test module starts with
its own flags): an httpx client and the official openai client."""
import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
