"""/docs works offline: the Swagger UI page names only this server's URLs, and each answers.
The app runs in-process (TestClient) over an idle fake core: the docs need no engine."""
from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from server.app import ServerSettings, create_app

KEY = "sk-test"


class IdleCore:
    """A CoreConnection whose core never speaks: enough for routes that do not generate."""
    max_model_len, pool_tokens, client_index = 64, 1024, 0
    block_size, max_num_seqs = 16, 256

    def start(self, deliver) -> None:
        pass

    def send(self, message) -> None:
        pass

    def is_alive(self) -> bool:
        return True

    async def stop(self, timeout: float) -> None:
        pass


def client(api_key: str | None = None) -> TestClient:
    return TestClient(create_app(IdleCore(), ServerSettings("tiny", api_key=api_key)))


def page_urls(html: str) -> list[str]:
    """Every URL the page loads: src and href attributes, and the spec's `url:`."""
    return (re.findall(r'(?:src|href)="([^"]+)"', html)
            + re.findall(r"url: '([^']+)'", html))


def test_docs_page_loads_only_local_assets_and_each_answers():
    with client() as http:
        page = http.get("/docs")
        assert page.status_code == 200 and "SwaggerUIBundle" in page.text
        urls = page_urls(page.text)
        assert {"/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css",
                "/openapi.json"} <= set(urls)
        for url in urls:
            assert url.startswith("/") and not url.startswith("//"), url
            answer = http.get(url)
            assert answer.status_code == 200, url
            assert answer.content, url
        assert http.get("/docs/assets/swagger-ui-bundle.js").headers["content-type"] in (
            "text/javascript; charset=utf-8", "application/javascript")


@pytest.mark.parametrize("path", ["/docs", "/docs/assets/swagger-ui-bundle.js",
                                  "/openapi.json"])
def test_docs_and_their_assets_are_behind_the_api_key(path):
    """--api-key guards every route but the probes and /metrics: the docs page, its assets
    and the schema are no exception."""
    with client(api_key=KEY) as http:
        assert http.get(path).status_code == 401
        assert http.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_disabled_docs_serve_nothing():
    app = create_app(IdleCore(), ServerSettings("tiny", enable_docs=False))
    with TestClient(app) as http:
        for path in ("/docs", "/docs/assets/swagger-ui.css", "/openapi.json"):
            assert http.get(path).status_code == 404, path
