"""Fast CIDEr-D against pycocoevalcap's Cider (the oracle) on thousands of captions, plus a hand example."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pycocoevalcap.cider.cider import Cider

from pipeline.metrics.cider import CiderD
from pipeline.world.captions import make_captions, tokenize
from pipeline.world.scene import SceneParams, sample_scene


def _oracle(refs: dict, cands: dict) -> np.ndarray:
    """pycocoevalcap on whitespace-joined tokens (each image once, df from these images' references)."""
    gts = {i: [" ".join(r) for r in refs[i]] for i in cands}
    res = {i: [" ".join(cands[i])] for i in cands}
    _, scores = Cider().compute_score(gts, res)
    return np.asarray(scores)


def _random_corpus(rng: np.random.Generator, num_images: int, vocab_size: int, max_len: int) -> tuple[dict, dict]:
    words = [f"w{i}" for i in range(vocab_size)]

    def sentence() -> list[str]:
        return [words[i] for i in rng.integers(0, vocab_size, int(rng.integers(0, max_len + 1)))]

    refs = {
        int(i): [sentence() for _ in range(int(rng.integers(1, 8)))]
        for i in rng.permutation(10 * num_images)[:num_images]
    }
    cands = {}
    for i, rs in refs.items():
        kind = rng.integers(3)
        cands[i] = (
            sentence()
            if kind == 0
            else list(rs[int(rng.integers(len(rs)))])
            if kind == 1
            else rs[0][: len(rs[0]) // 2] + sentence()
        )
    return refs, cands


@pytest.fixture(scope="module")
def world_corpus() -> tuple[dict, dict]:
    """Real-looking captions from the synthetic world: five per scene, tokenised like Karpathy's tokens."""
    rng = np.random.default_rng(7)
    refs = {}
    for i in range(600):
        scene = sample_scene(rng, SceneParams())
        refs[1000 + i] = [tokenize(c) for c in make_captions(scene, rng)]
    # candidates: a held-out caption of the image, another image's caption, or a truncated one
    cands = {}
    ids = list(refs)
    for j, i in enumerate(ids):
        kind = j % 3
        if kind == 0:
            cands[i] = refs[i].pop()
        elif kind == 1:
            cands[i] = list(refs[ids[(j + 1) % len(ids)]][0])
        else:
            cands[i] = refs[i][0][: max(1, len(refs[i][0]) - 3)]
    return refs, cands


@pytest.mark.parametrize("vocab_size,max_len", [(8, 12), (40, 18), (500, 25)])
def test_equals_pycocoevalcap_on_random_captions(vocab_size: int, max_len: int) -> None:
    rng = np.random.default_rng(vocab_size)
    refs, cands = _random_corpus(rng, 1000, vocab_size, max_len)
    ours = CiderD(refs).scores([cands[i] for i in refs], list(refs))
    oracle = _oracle(refs, cands)
    assert ours.shape == oracle.shape == (1000,)
    assert np.abs(ours - oracle).max() < 1e-9
    assert oracle.max() > 1.0  # the test is not vacuous: many candidates score well


def test_equals_pycocoevalcap_on_world_captions(world_corpus: tuple[dict, dict]) -> None:
    refs, cands = world_corpus
    ours = CiderD(refs).scores([cands[i] for i in refs], list(refs))
    oracle = _oracle(refs, cands)
    assert np.abs(ours - oracle).max() < 1e-9
    assert 0.3 < oracle.mean() < 5.0


def test_corpus_mode_with_several_samples_per_image(world_corpus: tuple[dict, dict]) -> None:
    """SCST layout: k samples per image in one call; each round of the oracle scores one sample per image."""
    refs, cands = world_corpus
    ids = list(refs)
    rng = np.random.default_rng(3)
    rounds = []
    for r in range(3):
        perm = rng.permutation(len(ids))
        rounds.append({i: list(cands[ids[perm[j]]]) if r else list(cands[i]) for j, i in enumerate(ids)})
    scorer = CiderD(refs, df_mode="corpus")
    flat_ids = [i for i in ids for _ in rounds]
    flat_cands = [rd[i] for i in ids for rd in rounds]
    ours = scorer.scores(flat_cands, flat_ids).reshape(len(ids), len(rounds))
    for r, rd in enumerate(rounds):
        assert np.abs(ours[:, r] - _oracle(refs, rd)).max() < 1e-9


def test_batch_mode_matches_pycocoevalcap_on_a_subset() -> None:
    rng = np.random.default_rng(11)
    refs, cands = _random_corpus(rng, 400, 30, 14)
    scorer = CiderD(refs, df_mode="batch")
    ids = list(refs)
    for start in (0, 57, 200):
        subset = ids[start : start + 60]
        ours = scorer.scores([cands[i] for i in subset], subset)
        assert np.abs(ours - _oracle(refs, {i: cands[i] for i in subset})).max() < 1e-9
    # corpus mode differs on a subset (df from all 400 images), so the modes are really different
    corpus = CiderD(refs).scores([cands[i] for i in ids[:60]], ids[:60])
    assert np.abs(corpus - scorer.scores([cands[i] for i in ids[:60]], ids[:60])).max() > 1e-3


def test_hand_computed_example() -> None:
    """Two images, refs 'a b' and 'c d': every n-gram has df 1, idf log 2, so the candidate 'a b' of image A
    has cosine 1 on unigrams and bigrams, 0 on 3- and 4-grams, no length penalty: 10 * (1+1+0+0)/4 = 5."""
    scorer = CiderD({"A": [["a", "b"]], "B": [["c", "d"]]})
    s = scorer.scores([["a", "b"], ["a", "b"], ["c"], []], ["A", "B", "B", "A"])
    assert s[0] == pytest.approx(5.0, abs=1e-12)
    assert s[1] == 0.0  # no overlap with image B's reference
    # 'c' vs 'c d': unigram cos = log2 / (log2 * sqrt(2)); lengths (bigram counts) 0 vs 1 -> penalty exp(-1/72)
    assert s[2] == pytest.approx(10 * (1 / math.sqrt(2)) / 4 * math.exp(-1 / 72), abs=1e-12)
    assert s[3] == 0.0  # an empty candidate scores 0


def test_clipping_and_length_penalty() -> None:
    """CIDEr-D clips repeated n-grams (min(tf_c, tf_r)) and penalises length differences."""
    refs = {0: [["a", "dog", "runs"]], 1: [["a", "cat", "sleeps"]], 2: [["two", "birds"]]}
    scorer = CiderD(refs)
    exact, repeated, longer = scorer.scores(
        [["a", "dog", "runs"], ["dog", "dog", "dog", "runs"], ["a", "dog", "runs", "x", "y", "z", "w", "v"]], [0, 0, 0]
    )
    assert exact > repeated and exact > longer
    assert exact == pytest.approx(_oracle(refs, {0: ["a", "dog", "runs"], 1: ["x"], 2: ["y"]})[0], abs=1e-12)


def test_token_id_mode_equals_word_mode(world_corpus: tuple[dict, dict]) -> None:
    refs, cands = world_corpus
    words = sorted({w for rs in refs.values() for r in rs for w in r} | {w for c in cands.values() for w in c})
    wid = {w: k + 4 for k, w in enumerate(words)}  # ids from 4 like pipeline.core.vocab (0..3 are specials)
    id_refs = {i: [[wid[w] for w in r] for r in rs] for i, rs in refs.items()}
    ids = list(refs)
    by_words = CiderD(refs).scores([cands[i] for i in ids], ids)
    scorer = CiderD(id_refs)
    assert scorer.id_mode
    by_lists = scorer.scores([[wid[w] for w in cands[i]] for i in ids], ids)
    # padded array as a sampler produces it: words, EOS (2), then PAD (0) or garbage after EOS
    width = max(len(c) for c in cands.values()) + 3
    arr = np.zeros((len(ids), width), dtype=np.int64)
    for row, i in enumerate(ids):
        toks = [wid[w] for w in cands[i]]
        arr[row, : len(toks)] = toks
        if len(toks) < width:
            arr[row, len(toks)] = 2
        arr[row, len(toks) + 1 :] = 9  # after EOS: ignored
    by_array = scorer.scores(arr, ids)
    assert np.abs(by_words - by_lists).max() < 1e-12
    assert np.abs(by_words - by_array).max() < 1e-12
    torch = pytest.importorskip("torch")
    assert np.abs(scorer.scores(torch.from_numpy(arr), ids) - by_words).max() < 1e-12


def test_strings_are_split_on_whitespace() -> None:
    refs = {1: ["a man rides a horse", "a person on a horse"], 2: ["a red bus"]}
    scorer = CiderD(refs)
    a = scorer.scores(["a man on a horse"], [1])
    b = scorer.scores([["a", "man", "on", "a", "horse"]], [1])
    assert a[0] == b[0] > 0


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="no reference captions"):
        CiderD({1: []})
    with pytest.raises(ValueError, match="df_mode"):
        CiderD({1: [["a"]]}, df_mode="train")
    scorer = CiderD({1: [["a"]]})
    with pytest.raises(ValueError, match="image id 5"):
        scorer.scores([["a"]], [5])
    with pytest.raises(ValueError, match="candidates but"):
        scorer.scores([["a"]], [1, 1])
    with pytest.raises(ValueError, match="token ids"):
        CiderD({1: [[4, 5]]}).scores([["a"]], [1])


def test_degenerate_inputs(recwarn: pytest.WarningsRecorder) -> None:
    """Empty candidates, empty references, no n-grams at all, zero-width arrays: zeros, no warnings."""
    scorer = CiderD({1: [["a", "b"]], 2: [[]]})
    assert scorer.scores([[], []], [1, 2]).tolist() == [0.0, 0.0]
    got = scorer.scores([["a", "b"], ["zz"]], [2, 1])
    assert np.abs(got - _oracle({1: [["a", "b"]], 2: [[]]}, {2: ["a", "b"], 1: ["zz"]})).max() < 1e-12
    assert CiderD({1: [["a", "b"]], 2: [[]]}, df_mode="batch").scores([[], ["a"]], [2, 2]).tolist() == [0.0, 0.0]
    assert scorer.scores([], []).shape == (0,)
    assert CiderD({1: [[5, 6]]}).scores(np.zeros((2, 0), dtype=np.int64), [1, 1]).tolist() == [0.0, 0.0]
    assert CiderD({1: [[]]}).scores([["a"]], [1]).tolist() == [0.0]
    assert len(recwarn) == 0


@pytest.mark.parametrize("df_mode", ["corpus", "batch"])
def test_save_and_load_give_identical_scores(world_corpus: tuple[dict, dict], tmp_path, df_mode: str) -> None:
    refs, cands = world_corpus
    ids = list(refs)[:200]
    scorer = CiderD({i: refs[i] for i in ids}, df_mode=df_mode)
    path = scorer.save(tmp_path / "cider.npz")
    loaded = CiderD.load(path)
    words = [cands[i] + ["unseen"] for i in ids]
    assert np.array_equal(loaded.scores(words, ids), scorer.scores(words, ids))
    id_scorer = CiderD({1: [[4, 5, 6]], "b": [[5, 6], [7]]}, df_mode=df_mode)
    id_loaded = CiderD.load(id_scorer.save(tmp_path / "ids.npz"))
    arr = np.array([[4, 5, 6, 2, 0], [5, 6, 7, 9, 2]])
    assert np.array_equal(id_loaded.scores(arr, [1, "b"]), id_scorer.scores(arr, [1, "b"]))


def test_load_rejects_bad_files(tmp_path) -> None:
    from pipeline.core.errors import PipelineError

    with pytest.raises(PipelineError, match="cache not found"):
        CiderD.load(tmp_path / "none.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(PipelineError, match="junk.npz is unreadable"):
        CiderD.load(tmp_path / "junk.npz")
    np.savez(tmp_path / "other.npz", meta=np.array('{"format": "x"}'))
    with pytest.raises(PipelineError, match="other.npz is unreadable: not a butd-caption CIDEr-D cache"):
        CiderD.load(tmp_path / "other.npz")
