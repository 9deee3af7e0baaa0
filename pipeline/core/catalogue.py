"""The catalogue of public files the toolkit reads: one :class:`CatalogueEntry` per file, looked up by name.

Each record gives the URL as the release publishes it (its README or code, with the repository and commit where
it was read), where it lands in the cache (``$BUTD_CACHE/downloads/<folder>/<filename>``), its kind (which
strict reader checks a download: ``pipeline.hub.verify``), licence and purpose. Files that a plain HTTP GET
cannot fetch (a Google Drive folder) carry the manual step instead of a URL. ``companions`` name the entries
fetched with it into the same folder (M2's ``vocab.pkl`` beside its weights, VinVL's labelmap beside its
detector), so readers that look for a companion next to a file find it. docs/downloads.md is this table.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from pipeline.core.errors import UsageError

#: detector weights layouts (docs/extractor.md#weights-layouts): a download must have exactly this one
DETECTOR_LAYOUTS = ("milvlg", "hf", "vinvl", "grid-feats")
#: the kinds of file, each checked after a download by its strict reader (pipeline.hub.verify.VERIFIERS)
KINDS = DETECTOR_LAYOUTS + ("clip", "labelmap", "hf-config", "m2-weights", "m2-vocab", "aoanet", "hdf5", "zip")

MILVLG = "MILVLG/bottom-up-attention.pytorch@4dbce86"
ONEDRIVE = "https://awma1-my.sharepoint.com/:u:/g/personal/yuz_l0_tn/"
VINVL_ZOO = "https://penzhanwu2.blob.core.windows.net/sgg/sgg_benchmark/vinvl_model_zoo/"
GRID = "https://dl.fbaipublicfiles.com/grid-feats-vqa/"
UNIMORE = "https://ailb-web.ing.unimore.it/publicfiles/drive/"
LXMERT = (
    "huggingface/transformers-research-projects@fccd0cd lxmert/extracting_data.py (hub id unc-nlp/frcnn-vg-finetuned)"
)
SGB = "microsoft/scene_graph_benchmark@8e14944 README.md"
M2_REPO = "aimagelab/meshed-memory-transformer@239100b"
M2_LICENCE = "BSD-3-Clause (aimagelab/meshed-memory-transformer LICENSE)"
OPENAI_CLIP = "https://openaipublic.azureedge.net/clip/models/"
#: openai/CLIP ``clip/clip.py`` ``_MODELS``: name -> (catalogue name, SHA-256 = the URL's parent folder, file name)
CLIP_RELEASES = (
    ("RN50", "clip-rn50", "afeb0e10f9e5a86da6080e35cf09123aca3b358a0c3e3b6c78a7b63bc04b6762", "RN50.pt"),
    ("RN101", "clip-rn101", "8fa8567bab74a42d41c5915025a8e4538c3bdbe8804a470a72f30b0d94fab599", "RN101.pt"),
    ("RN50x4", "clip-rn50x4", "7e526bd135e493cef0776de27d5f42653e6b4c8bf9e0f653bb11773263205fdd", "RN50x4.pt"),
    ("RN50x16", "clip-rn50x16", "52378b407f34354e150460fe41077663dd5b39c54cd0bfd2b27167a4a06ec9aa", "RN50x16.pt"),
    ("RN50x64", "clip-rn50x64", "be1cfb55d75a9666199fb2206c106743da0f6468c9d327f3e0d0a543a9919d9c", "RN50x64.pt"),
    ("ViT-B/32", "clip-vit-b32", "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af", "ViT-B-32.pt"),
    ("ViT-B/16", "clip-vit-b16", "5806e77cd80f8b59890b7e101eabd078d9fb84e6937f9e85e4ecb61988df416f", "ViT-B-16.pt"),
    ("ViT-L/14", "clip-vit-l14", "b8cca3fd41ae0c99ba7e8951adf17d267cdb84cd88be6f7c2e0eca1737a03836", "ViT-L-14.pt"),
    (
        "ViT-L/14@336px",
        "clip-vit-l14-336",
        "3035c92b350959924f9f00213499208652fc7ea050643e8b385c2dac08641f02",
        "ViT-L-14-336px.pt",
    ),
)
COCO_LICENCE = "COCO terms of use: annotations CC BY 4.0, images under the Flickr terms of their owners"


@dataclass(frozen=True)
class CatalogueEntry:
    """One public file: ``name`` (what options take), ``urls`` (tried in order; empty for a manual step),
    ``source`` (repository@commit and the file the URL was read from), ``folder``/``filename`` (its cache path),
    ``kind`` (its strict reader), ``size`` and ``sha256`` when the release publishes them, ``licence``,
    ``purpose``, ``companions`` (entries fetched with it into the same folder) and ``manual`` (the steps when
    no plain HTTP GET reaches it)."""

    name: str
    urls: tuple[str, ...]
    source: str
    folder: str
    filename: str
    kind: str
    licence: str
    purpose: str
    size: int | None = None
    sha256: str | None = None
    companions: tuple[str, ...] = ()
    manual: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"catalogue entry {self.name}: unknown kind {self.kind!r}")
        if not self.urls and not self.manual:
            raise ValueError(f"catalogue entry {self.name}: needs a URL or a manual step")


def _onedrive(share_id: str) -> tuple[str, ...]:
    return (f"{ONEDRIVE}{share_id}?download=1",)


ENTRIES: tuple[CatalogueEntry, ...] = (
    CatalogueEntry(
        "bua-r101",
        _onedrive("EaXvCC3WjtlLvvEfLr3oa8UBLA21tcLh4L8YLbYXl6jgjg"),
        f"{MILVLG} README.md (Pre-trained models, R101 k10-100)",
        "milvlg",
        "bua-caffe-frcn-r101_with_attributes.pth",
        "milvlg",
        "MILVLG/bottom-up-attention.pytorch LICENSE",
        "bottom-up R-101 detector (caffe mode, 10-100 boxes): extract, caption --weights",
    ),
    CatalogueEntry(
        "bua-r101-fix36",
        _onedrive("EUKhQ3hSRv9JrrW64qpNLSIBGoOjEGCkF8zvgBP9gKax-w"),
        f"{MILVLG} README.md (Pre-trained models, R101 k36)",
        "milvlg",
        "bua-caffe-frcn-r101_with_attributes_fix36.pth",
        "milvlg",
        "MILVLG/bottom-up-attention.pytorch LICENSE",
        "bottom-up R-101 detector (caffe mode, 36 boxes; use --boxes 36)",
    ),
    CatalogueEntry(
        "bua-r152",
        _onedrive("ETDgy4bY0xpGgsu5tEMzgLcBQjAwpnkKkltNTtPVuMj4GQ"),
        f"{MILVLG} README.md (Pre-trained models, R152)",
        "milvlg",
        "bua-caffe-frcn-r152.pth",
        "milvlg",
        "MILVLG/bottom-up-attention.pytorch LICENSE",
        "bottom-up R-152 detector (caffe mode)",
    ),
    CatalogueEntry(
        "frcnn-vg-finetuned",
        ("https://huggingface.co/unc-nlp/frcnn-vg-finetuned/resolve/main/pytorch_model.bin",),
        LXMERT,
        "hf-frcnn-vg-finetuned",
        "pytorch_model.bin",
        "hf",
        "the model card of unc-nlp/frcnn-vg-finetuned",
        "LXMERT's Visual Genome detector (hf layout; also hf:unc-nlp/frcnn-vg-finetuned)",
        companions=("frcnn-vg-finetuned-config",),
    ),
    CatalogueEntry(
        "frcnn-vg-finetuned-config",
        ("https://huggingface.co/unc-nlp/frcnn-vg-finetuned/resolve/main/config.yaml",),
        LXMERT,
        "hf-frcnn-vg-finetuned",
        "config.yaml",
        "hf-config",
        "the model card of unc-nlp/frcnn-vg-finetuned",
        "the HF detector's config.yaml (its test-time values)",
    ),
    CatalogueEntry(
        "vinvl-x152c4",
        (f"{VINVL_ZOO}vinvl_vg_x152c4.pth",),
        SGB,
        "vinvl",
        "vinvl_vg_x152c4.pth",
        "vinvl",
        "microsoft/scene_graph_benchmark LICENSE",
        "VinVL ResNeXt-152 C4 detector (1594 classes, 524 attributes): extract --weights",
        companions=("vinvl-labelmap",),
    ),
    CatalogueEntry(
        "vinvl-labelmap",
        (f"{VINVL_ZOO}VG-SGG-dicts-vgoi6-clipped.json",),
        SGB,
        "vinvl",
        "VG-SGG-dicts-vgoi6-clipped.json",
        "labelmap",
        "microsoft/scene_graph_benchmark LICENSE",
        "VinVL's class and attribute names (extract.labelmap)",
    ),
    *(
        CatalogueEntry(
            f"grid-{arch.lower()}",
            (f"{GRID}{arch}/{arch}.pth",),
            "facebookresearch/grid-feats-vqa@2677387 README.md",
            "grid-feats-vqa",
            f"{arch}.pth",
            "grid-feats",
            "facebookresearch/grid-feats-vqa LICENSE",
            f"grid-feats-vqa {arch} backbone for grid features (extract --boxes grid)",
        )
        for arch in ("R-50", "X-101", "X-152", "X-152pp")
    ),
    *(
        CatalogueEntry(
            name,
            (f"{OPENAI_CLIP}{sha}/{filename}",),
            "openai/CLIP clip/clip.py (_MODELS)",
            "clip",
            filename,
            "clip",
            "MIT (openai/CLIP LICENSE)",
            f"OpenAI's CLIP {model} image encoder, a TorchScript archive (extractors.clip: CLIP-ViL grid features)",
            sha256=sha,
        )
        for model, name, sha, filename in CLIP_RELEASES
    ),
    CatalogueEntry(
        "m2-coco",
        (f"{UNIMORE}meshed-memory-transformer/meshed_memory_transformer.pth",),
        f"{M2_REPO} README.md (Evaluation)",
        "m2",
        "meshed_memory_transformer.pth",
        "m2-weights",
        M2_LICENCE,
        "the released M2 captioner trained on COCO: caption --model",
        companions=("m2-vocab",),
    ),
    CatalogueEntry(
        "m2-vocab",
        ("https://raw.githubusercontent.com/aimagelab/meshed-memory-transformer/239100b/vocab.pkl",),
        f"{M2_REPO} vocab.pkl (repository root)",
        "m2",
        "vocab.pkl",
        "m2-vocab",
        M2_LICENCE,
        "M2's vocabulary (caption --vocab; fetched with m2-coco)",
    ),
    CatalogueEntry(
        "m2-coco-detections",
        (f"{UNIMORE}show-control-and-tell/coco_detections.hdf5",),
        f"{M2_REPO} README.md (Data preparation)",
        "m2",
        "coco_detections.hdf5",
        "hdf5",
        M2_LICENCE,
        "M2's COCO region features (import-features)",
    ),
    CatalogueEntry(
        "m2-annotations",
        (f"{UNIMORE}meshed-memory-transformer/annotations.zip",),
        f"{M2_REPO} README.md (Data preparation)",
        "m2",
        "annotations.zip",
        "zip",
        M2_LICENCE,
        "M2's COCO annotations and splits",
    ),
    CatalogueEntry(
        "aoanet",
        (),
        "husthuaan/AoANet@94ffe17 README.md",
        "aoanet",
        "model-best.pth",
        "aoanet",
        "husthuaan/AoANet LICENSE",
        "the released AoANet captioner: caption --model",
        manual="download model-best.pth and infos_aoanet-best.pkl from the Google Drive folder "
        "https://drive.google.com/drive/folders/1ab0iPNyxdVm79ml-oozsIlH7H6t6dIVl (a browser download)",
    ),
    CatalogueEntry(
        "karpathy-split",
        ("http://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip",),
        "cs.stanford.edu/people/karpathy/deepimagesent (the page publishing the split)",
        "karpathy",
        "caption_datasets.zip",
        "zip",
        COCO_LICENCE,
        "the Karpathy split of COCO (dataset_coco.json): prepare",
    ),
    CatalogueEntry(
        "coco2014-train",
        ("http://images.cocodataset.org/zips/train2014.zip",),
        "cocodataset.org/#download",
        "coco2014",
        "train2014.zip",
        "zip",
        COCO_LICENCE,
        "COCO 2014 training images",
    ),
    CatalogueEntry(
        "coco2014-val",
        ("http://images.cocodataset.org/zips/val2014.zip",),
        "cocodataset.org/#download",
        "coco2014",
        "val2014.zip",
        "zip",
        COCO_LICENCE,
        "COCO 2014 validation images",
    ),
    CatalogueEntry(
        "coco2014-annotations",
        ("http://images.cocodataset.org/annotations/annotations_trainval2014.zip",),
        "cocodataset.org/#download",
        "coco2014",
        "annotations_trainval2014.zip",
        "zip",
        COCO_LICENCE,
        "COCO 2014 captions and instances (captions_val2014.json, instances_*.json)",
    ),
)

CATALOGUE: dict[str, CatalogueEntry] = {e.name: e for e in ENTRIES}
if len(CATALOGUE) != len(ENTRIES):
    raise ValueError("a catalogue name is used twice")


def close_names(name: str, n: int = 4) -> list[str]:
    """Catalogue names that look like ``name`` (for a one-line error)."""
    return difflib.get_close_matches(name, list(CATALOGUE), n=n, cutoff=0.4)


def get_entry(name: str) -> CatalogueEntry:
    """The entry named ``name``; an unknown name is a :class:`UsageError` naming the close ones."""
    try:
        return CATALOGUE[name]
    except KeyError:
        close = close_names(name)
        hint = f" (close: {', '.join(close)})" if close else ""
        raise UsageError(f"unknown catalogue name {name!r}{hint}; `cli fetch --list` lists them") from None


def entry_with_companions(name: str) -> list[CatalogueEntry]:
    """``name``'s entry followed by its companions (each once)."""
    out: list[CatalogueEntry] = []
    todo = [name]
    while todo:
        entry = get_entry(todo.pop(0))
        if entry not in out:
            out.append(entry)
            todo += list(entry.companions)
    return out


def catalogue_markdown() -> str:
    """The catalogue as the Markdown table of docs/downloads.md (a test keeps the page in step)."""
    rows = ["| name | file (cache folder) | kind | URL | read from | licence | for |", "|---|---|---|---|---|---|---|"]
    for e in ENTRIES:
        where = ", ".join(f"<{u}>" for u in e.urls) if e.urls else f"manual: {e.manual}"
        companions = f" (with {', '.join(f'`{c}`' for c in e.companions)})" if e.companions else ""
        rows.append(
            f"| `{e.name}` | `{e.folder}/{e.filename}` | {e.kind} | {where} | {e.source} | {e.licence} | "
            f"{e.purpose}{companions} |"
        )
    return "\n".join(rows) + "\n"
