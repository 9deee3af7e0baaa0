"""Detector weights files are bounded before anything is allocated: a small file that declares what it does not hold
(a stray block index, a view far larger than its storage, a deflated archive member inflating to gigabytes, a conv
weight of the wrong rank, zero groups or zero width) is refused by `info` and `extract` in one line naming the file
and the key, in a child whose address space is limited, within a time limit, in every layout."""

from __future__ import annotations

import pickle
import re
import resource
import struct
import subprocess
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from detector_helpers import random_grid_feats_file, read_raw, save_layout, save_vinvl
from extract_helpers import tiny_spec
from forked_cli import ForkedCli
from PIL import Image

from extractors import weights as W
from extractors.random_weights import random_detector
from extractors.spec import BottomUpSpec
from extractors.vinvl import vinvl_x152c4

AS_LIMIT = 5 << 30  # importing torch maps ~3.6 GB of address space; a refusal must stay within ~1.4 GB more
SUFFIX = {"milvlg": ".pth", "airsplay": ".pkl", "hf": ".bin", "butd": ".pth", "vinvl": ".pth", "grid-feats": ".pth"}
STEM = {"vinvl": "backbone.body.stem.conv1.weight"}
CONV2 = {"vinvl": "backbone.body.layer1.0.conv2.weight"}
CONV1 = {"vinvl": "backbone.body.layer1.0.conv2.weight", "grid-feats": "backbone.res2.0.conv2.weight"}  # width source
FOUR_D = r"(a 4-d conv weight is expected|expected \[\d+, \d+, \d, \d\])"  # by the inference, or by the strict check
STRAY = {"vinvl": "backbone.body.layer3.999999.conv1.weight"}
CLS = {"vinvl": "roi_heads.box.predictor.cls_score.", "grid-feats": "roi_heads.box_predictor.cls_score."}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BUTD_CACHE", str(tmp_path / "cache"))


def grouped(flavor: str) -> BottomUpSpec:
    base = (
        vinvl_x152c4()
        if flavor == "vinvl"
        else BottomUpSpec(
            flavor="d2", expansion=2, res5_dilation=1, stride_in_1x1=False, stem_pool="pad1", has_attributes=False
        )
    )
    return base.with_(
        stem_channels=8,
        res2_bottleneck=8,
        groups=2,
        stage_blocks=(1, 1, 1),
        res5_blocks=1,
        rpn_channels=16,
        num_classes=11,
        num_attributes=7,
    )


def state_of(layout: str, tmp_path: Path) -> OrderedDict:
    """An honest state dict of ``layout`` (as its file holds it), random values."""
    if layout in ("milvlg", "airsplay", "hf", "butd"):
        spec = tiny_spec(flavor="d2" if layout in ("airsplay", "hf") else "caffe")
        path = save_layout(
            random_detector(spec, 0).state_dict(),
            "milvlg" if layout == "butd" else layout,
            tmp_path / f"honest{SUFFIX[layout]}",
        )
        return read_raw(path)[1]
    path = tmp_path / "honest.pth"
    if layout == "vinvl":
        save_vinvl(random_detector(grouped("vinvl"), seed=1), path, module_prefix=False)
    else:
        random_grid_feats_file(grouped("d2"), path, seed=1, num_classes=11, num_attributes=7, wrap=False)
    return OrderedDict(torch.load(path, weights_only=True))


def write(layout: str, sd: OrderedDict, path: Path) -> Path:
    """``sd`` in the container of ``layout`` (no check: the point is to write what a loader must refuse)."""
    if layout == "airsplay":
        with open(path, "wb") as fh:
            pickle.dump({"model": OrderedDict((k, v.numpy()) for k, v in sd.items())}, fh, protocol=2)
    elif layout == "butd":
        spec = tiny_spec()
        torch.save(
            {
                "format": W.BUTD_FORMAT,
                "version": W.BUTD_VERSION,
                "spec": spec.to_dict(),
                "model": dict(sd),
                "classes": [f"c{i}" for i in range(spec.num_classes - 1)],
                "attributes": [],
            },
            path,
        )
    else:
        torch.save({"model": dict(sd)} if layout == "milvlg" else dict(sd), path)
    return path


def key(table: dict, layout: str, default: str) -> str:
    return table.get(layout, default)


# --- the files --------------------------------------------------------------------------------------------------------
def stray_block(layout, sd):
    sd[key(STRAY, layout, "backbone.res4.999999.conv1.weight")] = torch.zeros(4, 4, 1, 1)
    return key(STRAY, layout, "backbone.res4.999999.conv1.weight"), "block 999999"


def zero_stride(layout, sd):
    """The classifier and box regressor declared with 2**34 classes over storages of one element (stride 0), shapes
    consistent with each other: terabytes once built."""
    prefix = key(CLS, layout, "roi_heads.box_predictor.cls_score.")
    box = prefix.replace("cls_score", "bbox_pred")
    n = 1 << 34
    rows = 4 * (n - 1) if layout in ("airsplay", "hf", "grid-feats") else 4 * n
    for p, m in ((prefix, n), (box, rows)):
        sd[p + "weight"] = torch.zeros(1).expand(m, sd[p + "weight"].shape[1])
        sd[p + "bias"] = torch.zeros(1).expand(m)
    return f"({prefix}|{box})weight", "storage"


def conv_0d(layout, sd):
    k = key(STEM, layout, "backbone.stem.conv1.weight")
    sd[k] = torch.tensor(1.0)
    return k, FOUR_D


def conv_1d(layout, sd):
    k = key(CONV2, layout, "backbone.res2.0.conv2.weight")
    sd[k] = torch.ones(8)
    return k, FOUR_D


def zero_groups(layout, sd):
    """A grouped 3x3 conv whose weight has more inputs per group than the conv has outputs: 8 // 16 = 0 groups."""
    k = key(CONV2, layout, "backbone.res2.0.conv2.weight")
    sd[k] = torch.zeros(8, 16, 3, 3)
    return k, "group"


def zero_width(layout, sd):
    k = key(CONV1, layout, "backbone.res2.0.conv1.weight")
    sd[k] = torch.zeros(0, sd[k].shape[1], 1, 1)
    return k, r"(width 0|has shape \[0, \d+, 1, 1\], expected)"


def inflating_member(path: Path, gigabytes: float = 2.5) -> Path:
    """Rewrite the torch zip at ``path`` with its first tensor's data member deflated and inflating to ``gigabytes``
    of zeros; the archive stays ~2.5 MB (the deflate stream is one full-flush block of zeros, repeated)."""
    chunk = 16 << 20
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    comp.compress(b"\0" * chunk)
    comp.flush(zlib.Z_FULL_FLUSH)
    block = comp.compress(b"\0" * chunk) + comp.flush(zlib.Z_FULL_FLUSH)
    n = int(gigabytes * (1 << 30)) // chunk
    stream = block * n + zlib.compressobj(9, zlib.DEFLATED, -15).flush()  # an empty final block
    crc, zeros = 0, b"\0" * chunk
    for _ in range(n):
        crc = zlib.crc32(zeros, crc)
    with zipfile.ZipFile(path) as zf:
        members = [(i, zf.read(i)) for i in zf.infolist()]
    target = next(i.filename for i, _ in members if i.filename.endswith("/data/0"))
    out, central = bytearray(), bytearray()
    for info, data in members:
        name = info.filename.encode()
        if info.filename == target:
            method, body, size, c = 8, stream, n * chunk, crc
        else:
            method, body, size, c = 0, data, len(data), zlib.crc32(data)
        central += (
            struct.pack(
                "<4s6H3L5H2L",
                b"PK\x01\x02",
                20,
                20,
                0,
                method,
                0,
                0,
                c,
                len(body),
                size,
                len(name),
                0,
                0,
                0,
                0,
                0,
                len(out),
            )
            + name
        )
        out += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0, c, len(body), size, len(name), 0)
        out += name + body
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), len(out), 0)
    path.write_bytes(bytes(out + central + end))
    return path


ATTACKS = {
    "stray_block": stray_block,
    "zero_stride": zero_stride,
    "conv_0d": conv_0d,
    "conv_1d": conv_1d,
    "zero_groups": zero_groups,
    "zero_width": zero_width,
}
CASES = [
    (a, lay)
    for a in ATTACKS
    for lay in ("milvlg", "airsplay", "hf", "butd", "vinvl", "grid-feats")
    if not (a == "zero_groups" and lay not in ("vinvl", "grid-feats"))
    and not (a in ("zero_stride", "zero_width") and lay == "airsplay")
]
# a pickle holds numpy arrays, rebuilt from their bytes: no strides; an empty array pickles through a global the
# unpickler refuses (one line naming the file)


#: one thread for the ``cli`` children that read the planted files
BOUNDED = {"OMP_NUM_THREADS": "1"}


def limit_address_space() -> None:
    """The ``cli`` child's address space limit, :data:`AS_LIMIT` (a file that slipped through dies, not the machine)."""
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


@pytest.fixture(scope="module")
def bounded(cli):
    """``bounded(*args)``: ``cli.py ARGS`` in a child limited to :data:`AS_LIMIT` of address space, forked from one
    interpreter of this module that has imported ``cli.py`` (:mod:`forked_cli`), with the environment the ``cli``
    fixture gives a child plus :data:`BOUNDED`."""
    with ForkedCli(cli.environment(BOUNDED)) as server:

        def run(*args: str) -> subprocess.CompletedProcess:
            try:
                return server(*args, env=cli.environment(BOUNDED), address_space=AS_LIMIT, timeout=180)
            except subprocess.TimeoutExpired:
                pytest.fail(f"`cli.py {' '.join(args[:2])}` still ran after 180 s")

        yield run


def refused_in_one_line(res: subprocess.CompletedProcess, path: Path, what: str, reason: str) -> str:
    lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert res.returncode not in (0, -9) and len(lines) == 1 and "Traceback" not in res.stderr, (
        res.returncode,
        res.stderr[-3000:],
    )
    line = " ".join(lines[0].split())
    assert path.name in line and re.search(f"'{what}'.*{reason}", line), line
    assert "out of memory" not in line, line
    return line


def extract_args(tmp_path: Path, weights: Path) -> list[str]:
    """``extract`` of one real JPEG written here with ``weights`` into ``tmp_path/store``."""
    folder = tmp_path / "photos"
    folder.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (240, 320, 3), dtype=np.uint8)).save(folder / "a.jpg")
    return [
        "extract",
        str(folder),
        "--device",
        "cpu",
        "--weights",
        str(weights),
        "--store",
        str(tmp_path / "store"),
        "--workers",
        "0",
    ]


@pytest.mark.parametrize("attack,layout", CASES)
def test_info_refuses_a_file_that_declares_what_it_does_not_hold(
    bounded, tmp_path: Path, attack: str, layout: str
) -> None:
    sd = state_of(layout, tmp_path)
    what, reason = ATTACKS[attack](layout, sd)
    path = write(layout, sd, tmp_path / f"detector{SUFFIX[layout]}")
    assert path.stat().st_size < 16 << 20
    refused_in_one_line(bounded("info", str(path)), path, what, reason)
    with pytest.raises(W.WeightsError, match=f"{path.name}.*'{what}'.*{reason}"):
        W.describe(path)


@pytest.mark.parametrize(
    "attack,layout",
    [
        ("stray_block", "milvlg"),
        ("zero_stride", "hf"),
        ("zero_stride", "vinvl"),
        ("zero_groups", "grid-feats"),
        ("conv_0d", "airsplay"),
        ("conv_0d", "butd"),
    ],
)
def test_extract_refuses_it_before_building_the_detector(bounded, tmp_path: Path, attack: str, layout: str) -> None:
    sd = state_of(layout, tmp_path)
    what, reason = ATTACKS[attack](layout, sd)
    path = write(layout, sd, tmp_path / f"detector{SUFFIX[layout]}")
    args = extract_args(tmp_path, path) + (["--boxes", "grid"] if layout == "grid-feats" else [])
    refused_in_one_line(bounded(*args), path, what, reason)
    assert not (tmp_path / "store" / "store.json").exists()


@pytest.mark.parametrize("layout", ["milvlg", "vinvl"])
def test_an_archive_member_inflating_to_gigabytes_is_refused_unread(bounded, tmp_path: Path, layout: str) -> None:
    path = write(layout, state_of(layout, tmp_path), tmp_path / "detector.pth")
    inflating_member(path)
    assert path.stat().st_size < 4 << 20
    with zipfile.ZipFile(path) as zf:
        member = next(i for i in zf.infolist() if i.compress_type == zipfile.ZIP_DEFLATED)
    assert member.file_size > 2 << 30
    refused_in_one_line(bounded("info", str(path)), path, re.escape(member.filename), "inflates")
    args = extract_args(tmp_path, path)
    refused_in_one_line(bounded(*args), path, re.escape(member.filename), "inflates")


def test_honest_files_of_every_layout_are_well_within_the_bounds(tmp_path: Path) -> None:
    for layout in ("milvlg", "airsplay", "hf", "butd", "vinvl", "grid-feats"):
        path = write(layout, state_of(layout, tmp_path), tmp_path / f"{layout}{SUFFIX[layout]}")
        facts = W.describe(path)
        assert facts["layout"] == layout and facts["keys"] > 10, facts


def test_a_pickled_array_declaring_its_shape_up_front_is_refused_unread(cli, tmp_path: Path) -> None:
    """numpy pickles an array as ``_reconstruct(ndarray, (0,), b'b')`` filled from its bytes: one that declares 2**34
    elements up front (which numpy would allocate) is refused before anything is allocated."""
    sd = state_of("airsplay", tmp_path)
    raw = pickle.dumps({"model": OrderedDict((k, v.numpy()) for k, v in sd.items())}, protocol=2)
    declared = b"\x8a\x05\x00\x00\x00\x00\x04\x85"  # the tuple (2**34,)
    huge, n = re.subn(rb"(ndarray\nq.)K\x00\x85", lambda m: m.group(1) + declared, raw, count=1, flags=re.S)
    assert n == 1  # the first array's shape argument: (0,) -> (2**34,)
    pkl = tmp_path / "detector.pkl"
    pkl.write_bytes(huge)
    res = cli("info", str(pkl), env=BOUNDED, timeout=180, preexec_fn=limit_address_space)
    lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert res.returncode == 1 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "detector.pkl" in lines[0] and "declared shape" in lines[0], lines[0]


def test_a_stored_spec_of_a_million_blocks_is_refused_before_it_is_built(cli, tmp_path: Path) -> None:
    path = write("butd", state_of("butd", tmp_path), tmp_path / "detector.pth")
    ckpt = torch.load(path, weights_only=True)
    ckpt["spec"]["stage_blocks"] = [1, 1, 1_000_000]
    torch.save(ckpt, path)
    refused_in_one_line(
        cli("info", str(path), env=BOUNDED, timeout=180, preexec_fn=limit_address_space),
        path,
        "stage_blocks",
        "at most 128 blocks per stage",
    )
