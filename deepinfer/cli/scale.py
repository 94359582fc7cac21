"""`deepinfer scale --role decode --count N`: add or remove workers of a running
disaggregated server (POST /admin/scale). Removed workers finish their requests first."""
from __future__ import annotations

import json
import os

from deepinfer.cli.errors import CLIError


def register(sub) -> None:
    p = sub.add_parser("scale", help="add or remove prefill/decode workers of a running server")
    p.add_argument("--role", required=True, choices=("prefill", "decode"))
    p.add_argument("--count", required=True, type=int, help="workers of that role to keep")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="the server's --admin-api-key, else its --api-key (default: "
                        "$OPENAI_API_KEY); the server needs --enable-admin-api")
    p.add_argument("--no-wait", action="store_true",
                   help="return once added workers are starting and removed ones draining")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds to wait for the server's answer (model loads, drains)")
    p.set_defaults(func=run)


def run(args, transport=None) -> int:
    """`transport`: an httpx transport (tests)."""
    import httpx

    if args.count < 1:
        raise CLIError(f"--count must be at least 1, got {args.count}")
    if args.timeout <= 0:
        raise CLIError("--timeout must be positive")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = {"role": args.role, "count": args.count, "wait": not args.no_wait}
    url = args.base_url.rstrip("/") + "/admin/scale"
    try:
        with httpx.Client(timeout=args.timeout, transport=transport) as http:
            response = http.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise CLIError(f"cannot reach {url}: {exc}") from None
    try:
        data = response.json()
    except ValueError:
        data = {}
    if response.status_code != 200:
        message = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
        raise CLIError(f"{url}: HTTP {response.status_code}: "
                       f"{message or response.text.strip()[:200]}")
    summary = {k: data.get(k) for k in ("role", "count", "added", "removed", "not_ready",
                                        "waiting_for", "num_released")}
    summary["workers"] = [f"{w['worker_id']}:{w['state']}" for w in data.get("workers", [])
                          if w.get("role") == args.role]
    print(json.dumps(summary))
    return 0
