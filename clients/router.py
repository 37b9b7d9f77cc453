"""A model behind a router (`slotwise serve --models-dir`): its gRPC addresses, asked of the
router's llama-server API (`POST /models/load`, then `GET /models` until it is loaded). The
client then speaks gRPC to that model's services as to any others; a new call after the model
was unloaded asks again (its ports change with its process)."""

from __future__ import annotations

import time

import httpx

__all__ = ["RouterError", "model_addresses"]


class RouterError(Exception):
    """The router refused, or the model did not load: the router's own words."""


def model_addresses(
    router: str, model: str, *, token: str | None = None, timeout: float = 600.0
) -> tuple[str, str]:
    """(prep, infer) of `model` on the router at `router` (http://HOST:PORT), loaded first."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=router.rstrip("/"), headers=headers, timeout=30) as http:
        loaded = False
        while time.monotonic() < deadline:
            info = _model(http, model)
            status = info["status"]
            if status["value"] == "loaded" and "slotwise" in info:
                return info["slotwise"]["prep_address"], info["slotwise"]["infer_address"]
            if loaded and status.get("failed") and status["value"] == "unloaded":
                raise RouterError(f"model {model!r} failed to load: {status.get('reason', '')}")
            if status["value"] in ("unloaded", "sleeping") and not loaded:
                r = http.post("/models/load", json={"model": info["id"]})
                if r.status_code != 200 and "already running" not in r.text:
                    raise RouterError(_said(r))
                loaded = True
            time.sleep(0.1)  # (the router's own pace: a load takes seconds)
    raise RouterError(f"model {model!r} was not loaded within {timeout:g} s")


def _model(http: httpx.Client, model: str) -> dict:  # type: ignore[type-arg]
    r = http.get("/models")
    if r.status_code != 200:
        raise RouterError(_said(r))
    for m in r.json()["data"]:
        if model == m["id"] or model in m.get("aliases", []):
            return dict(m)
    names = ", ".join(sorted(m["id"] for m in r.json()["data"]))
    raise RouterError(f"model {model!r} not found; the models here: {names}")


def _said(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}: {r.text[:200]}"
