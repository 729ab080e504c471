"""The OpenAPI document, generated from the same msgspec schemas the routes validate with."""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from appliance import __version__
from appliance.schemas import EmbeddingRequest

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "string"}},
        }
    },
}


def _errors(*statuses: int) -> dict[str, Any]:
    return {
        str(status): {
            "description": "error",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for status in statuses
    }


def _json_post(schema: str, summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
            },
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}},
                **_errors(400, 401, 404, 413, 415, 422, 429, 503, 504),
            },
        }
    }


def _get(summary: str, *errors: int) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}, **_errors(*errors)}}}


@cache
def openapi_spec() -> dict[str, Any]:
    (_,), components = msgspec.json.schema_components([EmbeddingRequest], ref_template="#/components/schemas/{name}")
    components["Error"] = _ERROR
    return {
        "openapi": "3.1.0",
        "info": {"title": "fleetbox", "version": __version__},
        "paths": {
            "/v1/embeddings": _json_post("EmbeddingRequest", "Create embeddings (OpenAI-compatible)"),
            "/v1/models": _get("List the catalog's models"),
            "/healthz": _get("Liveness"),
            "/readyz": _get("Readiness", 503),
            "/metrics": _get("Prometheus metrics"),
        },
        "components": {"schemas": components},
    }
