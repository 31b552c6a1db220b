import pytest
import torch

from torchtsp.train.data import ByteTokenizer, TokenWindows, default_corpus_files, load_corpus


def test_tokenizer_round_trip_non_ascii():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'naïve café — 東京 🚀'\n"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([tok.eot_id, *tok.encode("ab"), tok.eot_id, 300]) == "ab"
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"  # a cut multi-byte character is replaced, not an error


def test_default_corpus_files_are_sorted_capped_stdlib_sources():
    files = default_corpus_files(max_bytes=500_000)
    assert files and files == sorted(files)
    assert sum(f.stat().st_size for f in files) <= 500_000
    for f in files:
        assert f.suffix == ".py" and not {"site-packages", "test", "tests"} & set(f.parts)


def test_batches_depend_only_on_seed_and_step():
    corpus = torch.arange(10_000) % 257
    a, b = TokenWindows(corpus, 4, 16, seed=1), TokenWindows(corpus, 4, 16, seed=1)
    assert a.batch(5).shape == (4, 17) and a.batch(5).dtype == torch.int64
    assert torch.equal(b.batch(7), a.batch(7))  # b never saw steps 0..6: resuming needs no replay
    assert not torch.equal(a.batch(7), a.batch(8))
    assert not torch.equal(a.batch(7), TokenWindows(corpus, 4, 16, seed=2).batch(7))


def test_labels_are_inputs_shifted_by_one():
    windows = TokenWindows(torch.arange(1000), 3, 8, seed=0)
    tokens, labels = windows.inputs_and_labels(0)
    assert tokens.shape == labels.shape == (3, 8)
    assert torch.equal(labels[:, :-1], tokens[:, 1:])
    assert torch.equal(labels, tokens + 1)  # the corpus counts up, so each label is its input plus one


def test_user_file_and_folder(tmp_path):
    tok = ByteTokenizer()
    (tmp_path / "a.txt").write_text("héllo")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("world")
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01binary")
    (tmp_path / "image.png").write_bytes(b"not text by name")

    assert load_corpus(tmp_path / "a.txt").tolist() == tok.encode("héllo")
    ids = load_corpus(tmp_path).tolist()
    assert ids == tok.encode("héllo") + [tok.eot_id] + tok.encode("world")
    assert load_corpus(str(tmp_path), max_bytes=3).tolist() == tok.encode("héllo")[:3]


def test_missing_path_and_empty_corpus(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist.*text file or a folder"):
        load_corpus(tmp_path / "does-not-exist")
    with pytest.raises(ValueError, match="no text found"):
        load_corpus(tmp_path)


def test_too_short_corpus():
    with pytest.raises(ValueError, match="needs at least 33"):
        TokenWindows(torch.arange(20), 2, 32)
