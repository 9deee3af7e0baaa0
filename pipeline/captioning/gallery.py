"""A static HTML gallery of captioned photos: one ``index.html`` next to its thumbnails and pictures.

Layout of ``--gallery DIR``::

    DIR/index.html        every photo: thumbnail, caption, n-best with scores, boxes on demand, word filter
    DIR/thumbs/*.jpg      thumbnails (at most 360 pixels wide), written as each batch finishes
    DIR/pictures/*.png    the full pictures (pipeline.captioning.pictures), linked from each card
    DIR/records.jsonl     one JSON row per photo (the page's data; a journal, so a rerun only does the rest)

The page needs no server and no network: CSS and JavaScript are inline, images are relative links. Cards are
plain HTML (readable without JavaScript); the script adds the word filter, the photo count and the box
toggles; ``index.html?q=word`` opens it filtered, ``?boxes=1`` with every photo's boxes shown. Boxes are the few
regions the caption attends to, one label per object (:func:`pipeline.captioning.pictures.attended_regions`).
"""

from __future__ import annotations

import html
import io
import os
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from PIL import Image

from pipeline.captioning.journal import Journal
from pipeline.captioning.pictures import PALETTE, attended_regions, picture_name, region_labels, render_picture
from pipeline.core.fileio import atomic_write, atomic_write_bytes
from pipeline.core.keys import key_to_text
from pipeline.core.locks import acquire_lock

THUMB_WIDTH = 360

#: the gallery's look (the page of ``cli serve`` shares it)
STYLE = """
body{font-family:system-ui,sans-serif;margin:0;background:#f4f4f4;color:#222}
header{position:sticky;top:0;background:#fff;padding:10px 16px;border-bottom:1px solid
#ddd;display:flex;gap:12px;align-items:center;flex-wrap:wrap;z-index:2}
header h1{font-size:18px;margin:0}
#q{font-size:15px;padding:4px 8px;min-width:220px}
main{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:14px;padding:14px}
.card{background:#fff;border-radius:6px;box-shadow:0 1px 3px #0003;margin:0;overflow:hidden}
.photo{position:relative;line-height:0}
.photo img{width:100%;height:auto;display:block}
.boxes{display:none;position:absolute;inset:0}
.card.show .boxes,body.all .boxes{display:block}
.box{position:absolute;border:3px solid;box-sizing:border-box}
.box span{position:absolute;left:-3px;top:-3px;color:#fff;font:bold 12px/16px sans-serif;padding:0
4px;white-space:nowrap}
figcaption{padding:8px 10px}
.caption{font-size:16px;font-weight:600;margin:0 0 4px}
.nbest{margin:0 0 6px;padding-left:20px;font-size:13px;color:#555}
.score{color:#888;font-variant-numeric:tabular-nums}
.legend{font-size:12px;margin:4px 0}
.legend i{display:inline-block;width:10px;height:10px;margin-right:3px}
.failed{padding:10px;color:#a00}
.hidden{display:none}
"""

_SCRIPT = """
(function(){
  var cards=Array.prototype.slice.call(document.querySelectorAll('.card'));
  var q=document.getElementById('q'), count=document.getElementById('count');
  function update(){
    var words=q.value.toLowerCase().split(/\\s+/).filter(Boolean), shown=0;
    cards.forEach(function(c){
      var text=' '+(c.getAttribute('data-words')||'')+' ';
      var ok=words.every(function(w){return text.indexOf(' '+w)>=0;});
      c.classList.toggle('hidden',!ok); if(ok){shown++;}
    });
    count.textContent=shown+' of '+cards.length+' photos';
  }
  var m=location.search.match(/[?&]q=([^&]*)/);
  if(m){q.value=decodeURIComponent(m[1].replace(/\\+/g,' '));}
  q.addEventListener('input',update);
  var all=document.getElementById('all');
  all.addEventListener('change',function(){document.body.classList.toggle('all',all.checked);});
  if(/[?&]boxes=1/.test(location.search)){all.checked=true;document.body.classList.add('all');}
  cards.forEach(function(c){var b=c.querySelector('button');
  if(b){b.addEventListener('click',function(){c.classList.toggle('show');});}});
  update();
})();
"""


def _colour(n: int) -> str:
    r, g, b = PALETTE[n % len(PALETTE)]
    return f"#{r:02x}{g:02x}{b:02x}"


class GallerySink:
    """Writes thumbnails, pictures and records batch by batch, and the page at the end."""

    def __init__(
        self,
        directory: Path,
        settings: Mapping[str, Any],
        classes: Sequence[str],
        attributes: Sequence[str],
        force: bool = False,
        lock: Any = None,
    ) -> None:
        self.dir = Path(directory)
        (self.dir / "thumbs").mkdir(parents=True, exist_ok=True)
        (self.dir / "pictures").mkdir(parents=True, exist_ok=True)
        self.classes, self.attributes = list(classes), list(attributes)
        self.journal = Journal(
            {"records": self.dir / "records.jsonl"},
            settings,
            force=force,
            lock=lock
            or acquire_lock(
                self.dir / ".lock", f"gallery {self.dir}", "wait for it to finish or choose another --gallery"
            ),
        )

    def add(self, batch: Sequence[Any]) -> None:
        """Thumbnails and pictures of a finished batch, then its records (committed)."""
        rows = [self._record(res) for res in batch if key_to_text(res.key) not in self.journal.done]
        self.journal.append({"records": rows})

    def _record(self, res: Any) -> dict[str, Any]:
        row: dict[str, Any] = {
            "key": key_to_text(res.key),
            "image": key_to_text(str(res.path)),
            "source": self._source_link(res.path),
        }
        if res.error or res.image is None or res.regions is None:
            row["error"] = res.error or "no image"
            return row
        name = picture_name(res.key)
        h, w = res.image.shape[:2]
        thumb = Image.fromarray(res.image)
        thumb.thumbnail((THUMB_WIDTH, THUMB_WIDTH * 4))
        buf = io.BytesIO()
        thumb.save(buf, format="JPEG", quality=85)
        atomic_write_bytes(self.dir / "thumbs" / f"{name}.jpg", buf.getvalue())
        buf = io.BytesIO()
        render_picture(res, self.classes, self.attributes).save(buf, format="PNG")
        atomic_write_bytes(self.dir / "pictures" / f"{name}.png", buf.getvalue())
        labels = region_labels(res.regions, self.classes, self.attributes)
        regions = [
            {
                "box": [
                    round(float(reg.box[0]) / w, 4),
                    round(float(reg.box[1]) / h, 4),
                    round(float(reg.box[2]) / w, 4),
                    round(float(reg.box[3]) / h, 4),
                ],
                "label": reg.label,
                "words": reg.words,
            }
            for reg in attended_regions(res, labels)
        ]
        row.update(
            caption=res.caption,
            score=round(float(res.score), 4),
            nbest=[[c, round(float(s), 4)] for c, s in res.nbest],
            thumb=f"thumbs/{name}.jpg",
            picture=f"pictures/{name}.png",
            regions=regions,
        )
        return row

    def _source_link(self, path: Path) -> str:
        try:
            rel = os.path.relpath(os.path.abspath(path), os.path.abspath(self.dir))
        except ValueError:  # another drive (Windows)
            rel = os.path.abspath(path)
        return urllib.parse.quote(os.fsencode(rel).replace(os.sep.encode(), b"/"))

    def write_page(self) -> Path:
        """``index.html`` from the committed records (streamed, written atomically)."""
        return atomic_write(self.dir / "index.html", self._write_html)

    def _write_html(self, fh: BinaryIO) -> None:
        head = (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>captions: '
            f"{html.escape(self.dir.name)}</title>"
            '<meta name="viewport" content="width=device-width, '
            f'initial-scale=1"><style>{STYLE}</style></head>\n<body>\n'
            '<header><h1>captions</h1><input id="q" type="search" placeholder="filter by word" aria-label="filter by '
            'word">'
            '<label><input id="all" type="checkbox"> boxes on every photo</label><span '
            'id="count"></span></header>\n<main>\n'
        )
        fh.write(head.encode("utf-8"))
        for row in self.journal.read("records"):
            fh.write(card_html(row).encode("utf-8"))
        fh.write(f"</main>\n<script>{_SCRIPT}</script>\n</body></html>\n".encode("utf-8"))


def _score(value: Any) -> str:
    """A score as the page shows it (``null`` in the records, a non-finite score, is a dash)."""
    return f"{value:.3f}" if isinstance(value, (int, float)) else "\u2013"


def card_html(row: Mapping[str, Any]) -> str:
    """One photo's card (every string HTML-escaped)."""
    e = html.escape
    if "error" in row:
        return (
            f'<figure class="card" data-words="{e(row["image"].lower())}"><div class="failed">{e(row["image"])}<br>'
            f"not captioned: {e(row['error'])}</div></figure>\n"
        )
    words = " ".join([row["caption"]] + [c for c, _ in row["nbest"]] + [r["label"] for r in row["regions"]]).lower()
    boxes = "".join(
        f'<div class="box" style="left:{100 * b[0]:.2f}%;top:{100 * b[1]:.2f}%;width:{100 * (b[2] - b[0]):.2f}%;'
        f'height:{100 * (b[3] - b[1]):.2f}%;border-color:{_colour(n)}"><span style="background:{_colour(n)}">{n + 1} '
        f"{e(r['label'])}</span></div>"
        for n, r in enumerate(row["regions"])
        for b in [r["box"]]
    )
    legend = " ".join(
        f'<span><i style="background:{_colour(n)}"></i>{n + 1} '
        f"{e(r['label'])}{' &larr; ' + e(', '.join(r['words'])) if r['words'] else ''}</span>"
        for n, r in enumerate(row["regions"])
    )
    items = "".join(f'<li>{e(c)} <span class="score">{_score(s)}</span></li>' for c, s in row["nbest"])
    nbest = f'<ol class="nbest">{items}</ol>' if len(row["nbest"]) > 1 else ""
    return (
        f'<figure class="card" id="{e(row["key"])}" data-words="{e(words)}"><div class="photo">'
        f'<a href="{e(row["picture"])}"><img src="{e(row["thumb"])}" alt="{e(row["caption"])}" loading="lazy"></a>'
        f'<div class="boxes">{boxes}</div></div><figcaption><p class="caption">{e(row["caption"])} '
        f'<span class="score">{_score(row["score"])}</span></p>{nbest}<div class="legend">{legend}</div>'
        f'<button type="button">boxes</button> <a href="{e(row["picture"])}">picture</a> · '
        f'<a href="{e(row["source"])}">photo</a> · <span class="score" '
        f'title="{e(row["image"])}">{e(row["key"])}</span></figcaption></figure>\n'
    )
