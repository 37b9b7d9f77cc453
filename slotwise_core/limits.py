"""Limits that a service and the HTTP edge both apply, defined once (stdlib only: the client
package imports it without the services' dependencies)."""

from __future__ import annotations

DEFAULT_MAX_IMAGES = 64  # per request: prep's --max-images, and the edge's before any fetch
