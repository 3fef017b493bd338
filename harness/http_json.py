"""`http`: one stdlib (urllib) JSON request that never raises, for the GPU scripts that start servers and poll them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def http(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, str]:
    """GET `url` (POST `body` as JSON when given) -> (status, text); status 0 with the error's repr when no
    HTTP answer came (refused, reset, timeout: not up yet)."""
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except Exception as e:  # noqa: BLE001 - refused / reset / timeout: not up yet
        return 0, repr(e)
