"""The two HTML pages of ``cli serve``: ``GET /`` (drop or pick photos, see their captions and boxes) and
``GET /docs`` (the OpenAPI description as plain HTML).

Both are self-contained: inline CSS and script, nothing from a network. The try-it page has the gallery's look
(:data:`pipeline.captioning.gallery.STYLE`, its box palette) and builds every card with ``textContent`` (no
client-supplied text is ever parsed as HTML); boxes are the answer's ``regions``, drawn over the photo.
"""

from __future__ import annotations

import html
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeline.captioning.gallery import STYLE
from pipeline.captioning.pictures import PALETTE
from pipeline.serving.settings import ServeSettings


@lru_cache(maxsize=1)
def _template() -> str:
    return (Path(__file__).with_name("page.html")).read_text(encoding="utf-8")


def page_html(settings: ServeSettings, about: dict[str, Any]) -> str:
    """The try-it page with this server's limits (never the token itself: only whether one is needed)."""
    cfg = {
        "max_images": settings.max_images,
        "max_beam_size": settings.max_beam_size,
        "max_n_best": settings.max_n_best,
        "beam_size": int(about.get("beam_size") or 1),
        "token": settings.token is not None,
    }
    js = json.dumps(cfg).replace("<", "\\u003c")
    return (
        _template()
        .replace("/*STYLE*/", STYLE)
        .replace("/*CONFIG*/null", js)
        .replace("/*PALETTE*/[]", json.dumps([list(c) for c in PALETTE]))
    )


def docs_html(spec: dict[str, Any]) -> str:
    """The OpenAPI description as one readable page: each route, its parameters, bodies and answers."""
    e = html.escape
    rows = []
    for path, methods in spec.get("paths", {}).items():
        for method, op in methods.items():
            params = ", ".join(f"{p['name']} ({p['in']})" for p in op.get("parameters", []))
            bodies = ", ".join(op.get("requestBody", {}).get("content", {}))
            answers = "; ".join(f"{code} {r.get('description', '')}" for code, r in op.get("responses", {}).items())
            rows.append(
                f"<tr><td><code>{e(method.upper())} {e(path)}</code></td><td>{e(op.get('summary', ''))}</td>"
                f"<td>{e(params)}</td><td>{e(bodies)}</td><td>{e(answers)}</td></tr>"
            )
    info = spec.get("info", {})
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{e(info.get("title", ""))} API</title>'
        f"<style>{STYLE}table{{border-collapse:collapse;margin:14px;background:#fff}}"
        "td,th{border:1px solid #ddd;padding:6px;"
        f"vertical-align:top;font-size:14px}}</style></head><body><header><h1>{e(info.get('title', ''))} API "
        f'{e(info.get("version", ""))}</h1><a href="openapi.json">openapi.json</a></header><p style="margin:14px">'
        f"{e(info.get('description', ''))}</p><table><tr><th>route</th><th>what</th><th>parameters</th><th>bodies</th>"
        f"<th>answers</th></tr>{''.join(rows)}</table></body></html>"
    )
