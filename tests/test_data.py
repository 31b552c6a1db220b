"""Training data: tokenizers, Megatron's indexed format (checked by a reader written here from the published
layout), prepare-data, packing, epochs, blends, bad input, flat resident memory."""

import json
import struct

import numpy as np
import pytest
import torch

from torchtsp.data.documents import default_corpus_files
from torchtsp.data.indexed import IndexedDataset
from torchtsp.data.prepare import prepare
from torchtsp.data.samples import BatchStream, EpochOrder, PackedSamples
from torchtsp.data.sources import TokenSource, builtin_corpus, check_source, open_source, parse_blend
from torchtsp.data.tokenizers import ByteTokenizer, HFTokenizer

# ------------------------------------------------------------------ helpers written from the format, not the code

MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                   8: np.uint16}


def read_megatron(prefix):
    """An independent MMIDIDX v1 reader: the list of sequences of PREFIX.bin/.idx."""
    idx = open(f"{prefix}.idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", idx, 9)
    assert version == 1
    at = 9 + 8 + 1 + 8 + 8
    lengths = np.frombuffer(idx, np.int32, n_seq, at)
    pointers = np.frombuffer(idx, np.int64, n_seq, at + 4 * n_seq)
    docs = np.frombuffer(idx, np.int64, n_doc, at + 12 * n_seq)
    assert docs[0] == 0 and docs[-1] == n_seq
    data = open(f"{prefix}.bin", "rb").read()
    dtype = MEGATRON_DTYPES[code]
    return code, [np.frombuffer(data, dtype, n, p).tolist() for n, p in zip(lengths, pointers)]


def write_megatron(prefix, sequences, code):
    """A Megatron-format pair written here, as Megatron's builder lays it out."""
    dtype = np.dtype(MEGATRON_DTYPES[code])
    lengths = np.array([len(s) for s in sequences], np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64) * dtype.itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(sequences) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(sequences) + 1, dtype=np.int64).tobytes())


CORPUS = ["the cat sat on the mat", "a dog ran in the park", "naïve café — 東京 🚀", "the end"] * 6


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained here, with its EOS named in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A word-level tokenizer with 70,000 ids: its datasets need int32."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("wide")
    vocab = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "w69999"}}))
    return folder


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


# ------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_round_trip_non_ascii():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'naïve café — 東京 🚀'\n"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([tok.eot_id, *tok.encode("ab"), tok.eot_id, 300]) == "ab"
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"  # a cut multi-byte character is replaced, not an error


def test_hf_tokenizer_reads_eos_and_fingerprint(bpe_dir, tmp_path):
    tok = HFTokenizer(bpe_dir)
    assert tok.eos_id == tok.tokenizer.token_to_id("<eos>") and len(tok.fingerprint) == 64
    assert tok.decode(tok.encode("the cat")) == "the cat"
    (tmp_path / "tokenizer.json").write_text((bpe_dir / "tokenizer.json").read_text()[:500])  # truncated
    with pytest.raises(ValueError, match=r"tokenizer.json is not a valid tokenizer file") as e:
        HFTokenizer(tmp_path)
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)


def test_default_corpus_files_are_sorted_capped_stdlib_sources():
    files = default_corpus_files(max_bytes=500_000)
    assert files and files == sorted(files)
    assert sum(f.stat().st_size for f in files) <= 500_000
    for f in files:
        assert f.suffix == ".py" and not {"site-packages", "test", "tests"} & set(f.parts)


def test_text_folders_are_tokenized_on_the_fly_with_eos(tmp_path):
    tok = ByteTokenizer()
    (tmp_path / "a.txt").write_text("héllo")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("world")
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01binary")
    (tmp_path / "image.png").write_bytes(b"not text by name")
    source = open_source(str(tmp_path), tok)
    assert source.tokens.tolist() == tok.encode("héllo") + [256] + tok.encode("world") + [256]
    assert builtin_corpus(tok, max_bytes=100_000).max() == 256


# ------------------------------------------------------------------ prepare-data and the indexed format


@pytest.mark.parametrize("kind", ["bpe_uint16", "wide_int32"])
def test_prepare_data_matches_an_independent_reader(request, tmp_path, kind):
    folder = request.getfixturevalue("bpe_dir" if kind == "bpe_uint16" else "wide_dir")
    texts = CORPUS if kind == "bpe_uint16" else [" ".join(f"w{(7 * i + j) % 70_000}" for j in range(i % 9 + 1))
                                                 for i in range(0, 70_000, 1000)]
    write_jsonl(tmp_path / "part1.jsonl", texts[:10])
    write_jsonl(tmp_path / "part2.jsonl", texts[10:])
    tok = HFTokenizer(folder)
    result = prepare([tmp_path / "part1.jsonl", tmp_path / "part2.jsonl"], str(folder), str(tmp_path / "ds"),
                     progress=False)
    code, sequences = read_megatron(tmp_path / "ds")
    assert code == (8 if kind == "bpe_uint16" else 4)  # uint16 when the vocabulary fits, else int32
    assert sequences == [tok.encode(t) + [tok.eos_id] for t in texts]
    sidecar = json.loads((tmp_path / "ds.json").read_text())
    assert sidecar["tokenizer"]["fingerprint"] == tok.fingerprint and sidecar["documents"] == len(texts)
    assert sidecar["tokens"] == sum(map(len, sequences)) == result["tokens"]
    assert not list(tmp_path.glob("*.partial"))


def test_prepare_data_workers_keep_input_order(bpe_dir, tmp_path):
    texts = [f"document {i} " + CORPUS[i % len(CORPUS)] * (i % 5 + 1) for i in range(700)]  # several chunks
    write_jsonl(tmp_path / "in.jsonl", texts)
    (tmp_path / "note.md").write_text("a plain text document")
    inputs = [tmp_path / "in.jsonl", tmp_path / "note.md"]
    prepare(inputs, str(bpe_dir), str(tmp_path / "one"), workers=1, progress=False)
    prepare(inputs, str(bpe_dir), str(tmp_path / "two"), workers=2, progress=False)
    assert read_megatron(tmp_path / "one") == read_megatron(tmp_path / "two")
    assert len(read_megatron(tmp_path / "two")[1]) == 701


@pytest.mark.parametrize("code", [4, 5, 1])
def test_a_megatron_file_written_here_is_read_exactly(tmp_path, code):
    rng = np.random.default_rng(code)
    high = 250 if code == 1 else 100_000
    sequences = [rng.integers(0, high, rng.integers(1, 40)).tolist() for _ in range(30)]
    write_megatron(tmp_path / "mega", sequences, code)
    dataset = IndexedDataset(tmp_path / "mega")
    assert dataset.dtype == MEGATRON_DTYPES[code] and dataset.n_documents == 30
    assert [dataset.sequence(i).tolist() for i in range(30)] == sequences
    source = open_source(str(tmp_path / "mega"), ByteTokenizer())  # no sidecar, as Megatron writes it
    assert source.tokens[:len(source)].tolist() == [t for s in sequences for t in s]
    assert source.max_id() == max(max(s) for s in sequences)


# ------------------------------------------------------------------ bad input


def _damage(tmp_path, case):
    write_megatron(tmp_path / "d", [[1, 2, 3]] * 20, 8)
    if case == "missing bin":
        (tmp_path / "d.bin").unlink()
    elif case == "missing idx":
        (tmp_path / "d.idx").unlink()
    elif case == "truncated bin":
        (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:50])
    elif case == "magic":
        (tmp_path / "d.idx").write_bytes(b"NOTMMID" + (tmp_path / "d.idx").read_bytes()[7:])
    elif case == "version":
        raw = bytearray((tmp_path / "d.idx").read_bytes())
        raw[9:17] = struct.pack("<Q", 2)
        (tmp_path / "d.idx").write_bytes(bytes(raw))
    return str(tmp_path / "d")


@pytest.mark.parametrize("case,match", [
    ("missing bin", r"d.bin does not exist.*needs both"),
    ("missing idx", r"d.idx does not exist.*needs both"),
    ("truncated bin", r"d.bin is truncated"),
    ("magic", r"not a Megatron index file"),
    ("version", r"index version 2 is not supported"),
])
def test_damaged_datasets_are_one_line_errors(tmp_path, case, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match) as e:
        open_source(_damage(tmp_path, case), ByteTokenizer())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("line,match", [
    ("{not json", r"bad.jsonl:2: not a JSON object"),
    ('{"body": "x"}', r"bad.jsonl:2: the record has no 'text' field; choose the field with --text-key"),
])
def test_bad_jsonl_names_file_and_line_and_writes_nothing(bpe_dir, tmp_path, line, match):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        prepare([tmp_path / "bad.jsonl"], str(bpe_dir), str(tmp_path / "out"), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nothing half-written


def test_empty_inputs_and_datasets_are_refused(bpe_dir, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no documents with text"):
        prepare([tmp_path / "empty.jsonl"], str(bpe_dir), str(tmp_path / "out"), progress=False)
    write_megatron(tmp_path / "none", [], 8)
    with pytest.raises(ValueError, match="none is empty; a sample needs seq_len"):
        check_source(open_source(str(tmp_path / "none"), ByteTokenizer()), 257, ByteTokenizer(), 16, "--data")


def test_ids_outside_the_vocabulary_and_another_tokenizer_are_refused(bpe_dir, wide_dir, tmp_path):
    write_jsonl(tmp_path / "c.jsonl", CORPUS)
    prepare([tmp_path / "c.jsonl"], str(bpe_dir), str(tmp_path / "bpe"), progress=False)
    source = open_source(str(tmp_path / "bpe"), ByteTokenizer())
    with pytest.raises(ValueError, match="was prepared with another tokenizer .* but the model uses"):
        check_source(source, 70_000, HFTokenizer(wide_dir), 4, "--data")
    with pytest.raises(ValueError, match="holds token id .* outside the model's vocabulary of 100"):
        check_source(source, 100, HFTokenizer(bpe_dir), 4, "--data")
    check_source(source, 300, HFTokenizer(bpe_dir), 4, "--data")


@pytest.mark.parametrize("spec", ["0 A 1 B", "-1 A 2 B", "x A 1 B", "nan A 1 B", "0.5 A 0.5"])
def test_blend_weights_must_be_positive_numbers(spec):
    with pytest.raises(ValueError, match="blend"):
        parse_blend(spec)
    assert parse_blend("0.7 A 0.3 B") == [(0.7, "A"), (0.3, "B")]


# ------------------------------------------------------------------ packing, order, epochs, blends


def _source(n, name="s", offset=0):
    return TokenSource(name, np.arange(offset, offset + n, dtype=np.int64), "tensor")


def test_samples_are_consecutive_windows_of_the_stream():
    samples = PackedSamples(_source(100), 8)
    assert len(samples) == (100 - 1) // 8
    assert samples.sample(2).tolist() == list(range(16, 25))  # 9 ids; the next sample starts at its last id


def test_every_sample_is_visited_once_per_epoch_in_a_new_order():
    order = EpochOrder(1000, seed=3)
    first = [order(v) for v in range(1000)]
    second = [order(v) for v in range(1000, 2000)]
    assert {e for e, _ in first} == {0} and {e for e, _ in second} == {1}
    assert sorted(i for _, i in first) == list(range(1000)) == sorted(i for _, i in second)
    assert [i for _, i in first] != [i for _, i in second] != list(range(1000))
    assert [EpochOrder(1000, seed=3)(v) for v in range(1500, 1510)] == second[500:510]  # no replay needed


def test_a_stream_resumes_from_its_position():
    def stream():
        return BatchStream([(0.5, PackedSamples(_source(5000, "a"), 16)), (0.5, PackedSamples(_source(900, "b"), 16))],
                           4, seed=1)

    full = stream()
    batches = [full.next_batch() for _ in range(40)]  # b (56 samples) wraps into its third epoch
    resumed = stream()
    half = stream()
    for _ in range(15):
        half.next_batch()
    resumed.set_position(json.loads(json.dumps(half.position())))
    assert all(torch.equal(resumed.next_batch(), b) for b in batches[15:])
    with pytest.raises(ValueError, match="resume with the run's own --data"):
        BatchStream([(1.0, PackedSamples(_source(100), 8))], 2).set_position(half.position())
    # As many datasets, other ids: the position counts samples of other data (a fingerprint, not a count).
    other = BatchStream([(0.5, PackedSamples(_source(5000, "a", 7), 16)), (0.5, PackedSamples(_source(900, "b"), 16))],
                        4, seed=1)
    with pytest.raises(ValueError, match="--reset-data"):
        other.set_position(half.position())
    other.set_position(half.position(), reset=True)
    assert other.drawn == [0, 0]


def test_blend_proportions_match_the_weights():
    a, b, c = (PackedSamples(_source(n, name, off), 8) for n, name, off in
               ((20_000, "a", 0), (3_000, "b", 10**6), (50_000, "c", 2 * 10**6)))
    stream = BatchStream([(0.6, a), (0.3, b), (0.1, c)], 10, seed=0)
    picks = [d for _ in range(500) for d, _, _ in stream.next_rows(10)]
    shares = np.bincount(picks, minlength=3) / len(picks)
    assert np.all(np.abs(shares - [0.6, 0.3, 0.1]) <= 0.02), shares
    batch = stream.next_batch()
    assert batch.shape == (10, 9) and batch.dtype == torch.int64


def test_reading_every_sample_keeps_resident_memory_flat(tmp_path):
    """A 24 MB dataset read whole, sample by sample: resident memory grows by far less than the dataset."""
    from torchtsp.train.metrics import resident_bytes

    if resident_bytes() is None:
        pytest.skip("no /proc on this platform")
    ids = (np.arange(12_000_000) % 50_000).astype(np.uint16)
    write_megatron(tmp_path / "big", [ids[i:i + 100_000] for i in range(0, ids.size, 100_000)], 8)
    del ids
    source = open_source(str(tmp_path / "big"), ByteTokenizer())
    stream = BatchStream([(1.0, PackedSamples(source, 256))], 64, seed=0)
    stream.next_batch()
    before = resident_bytes()
    for _ in range(len(stream.datasets[0]) // 64):
        stream.next_batch()
    grown = resident_bytes() - before
    assert stream.epoch >= 1.0
    # The permutation of 46,874 samples is 0.2 MB and a batch 0.1 MB; a mapped file would add its 24 MB.
    assert grown < 4 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB"


def test_text_for_a_model_with_its_own_tokenizer_is_read_with_it(bpe_dir, tmp_path):
    from torchtsp.train.config import TrainConfig
    from torchtsp.train.data import TrainData

    (tmp_path / "notes.txt").write_text("the cat sat on the mat")
    cfg = TrainConfig(init_from_hf=str(bpe_dir), data=str(tmp_path / "notes.txt"), seq_len=4, batch_size=1)
    data = TrainData(cfg, vocab_size=300)
    tok = HFTokenizer(bpe_dir)
    assert data.train.datasets[0].source.tokens.tolist() == tok.encode("the cat sat on the mat") + [tok.eos_id]
    assert isinstance(TrainData(TrainConfig(seq_len=4), 257).tokenizer, ByteTokenizer)  # a preset: bytes


# ------------------------------------------------------------------ hostile files (issue 38's probes, by class)


def write_raw_index(prefix, code, lengths, pointers, docs, bin_bytes):
    """A .bin/.idx pair laid out by the MMIDIDX v1 spec from the arrays given as they are (no checks: a crafted
    file), the counts in the header taken from the arrays."""
    with open(f"{prefix}.bin", "wb") as f:
        f.write(bin_bytes)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(lengths), len(docs)))
        f.write(np.asarray(lengths, np.int32).tobytes() + np.asarray(pointers, np.int64).tobytes())
        f.write(np.asarray(docs, np.int64).tobytes())
    return str(prefix)


@pytest.mark.parametrize("lengths,pointers,docs,match", [
    ([3, -2, 3], [0, 6, 2], [0, 1, 2, 3], r"d.idx is damaged or crafted: sequence 1 has a negative length \(-2\)"),
    ([3, 3, 3], [0, 6, -4], [0, 1, 2, 3], r"d.idx is damaged or crafted: sequence 2 starts at a negative byte"),
    ([3, 3, 3], [0, 6, 2**62], [0, 1, 2, 3], r"d.bin is truncated: 18 bytes, its index needs .* \(sequence 2\)"),
    ([3, 3, 3], [0, 6, 12], [1, 2, 3], r"document index runs from 1 to 3, not from 0 to the sequence count 3"),
    ([3, 3, 3], [0, 6, 12], [0, 1, 2], r"document index runs from 0 to 2, not from 0 to the sequence count 3"),
    ([3, 3, 3], [0, 6, 12], [0, 2, 1, 3], r"document index falls from 2 to 1 \(entry 2\)"),
    ([3, 3, 3], [0, 6, 12], [], r"document index is empty"),
])
def test_an_inconsistent_index_is_one_line_naming_file_and_problem(tmp_path, lengths, pointers, docs, match):
    prefix = write_raw_index(tmp_path / "d", 8, lengths, pointers, docs, np.arange(9, dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match=match) as e:
        open_source(prefix, ByteTokenizer())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("code,name", [(6, "float64"), (7, "float32")])
def test_a_float_dataset_is_refused_naming_file_and_dtype(tmp_path, code, name):
    values = np.array([1.0, np.nan, 3.0, 4.0] * 10, MEGATRON_DTYPES[code])
    prefix = write_raw_index(tmp_path / "f", code, [40], [0], [0, 1], values.tobytes())
    with pytest.raises(ValueError, match=rf"f.idx: dtype {name} \(Megatron code {code}\) holds no token ids"):
        open_source(prefix, ByteTokenizer())


def _prepared(tmp_path, sidecar_change):
    write_megatron(tmp_path / "p", [[1, 2, 3, 256]] * 20, 8)
    sidecar = {"format": "megatron-mmidx-v1", "tokenizer": {"fingerprint": "byte", "vocab_size": 257, "eos_id": 256,
                                                             "bos_id": None, "path": "byte"},
               "dtype": "uint16", "documents": 20, "tokens": 80, "max_id": 256, "eos_appended": True,
               "text_key": "text", "inputs": ["x.jsonl"]}
    sidecar_change(sidecar)
    (tmp_path / "p.json").write_text(json.dumps(sidecar))
    return str(tmp_path / "p")


@pytest.mark.parametrize("change,match", [
    (lambda s: s.update(tokenizer="byte"), r"field 'tokenizer' must be an object, got \"byte\""),
    (lambda s: s["tokenizer"].update(fingerprint=5), r"field 'tokenizer.fingerprint' must be a string, got 5"),
    (lambda s: s["tokenizer"].update(path=["x"]), r"field 'tokenizer.path' must be a string or null"),
    (lambda s: s.update(max_id="256"), r"field 'max_id' must be a token id"),
    (lambda s: s.update(max_id=-1), r"field 'max_id' must be a token id"),
    (lambda s: s.update(tokens=True), r"field 'tokens' must be a count"),
    (lambda s: s.update(inputs="x.jsonl"), r"field 'inputs' must be a list of strings"),
    (lambda s: s.clear() or s.update(tokens=1e3), r"field 'tokens' must be a count"),
    (lambda s: s.update(tokens=81), r"p.json describes another dataset \(tokens 81, but .*p holds 80\)"),
    (lambda s: s.update(dtype="int32"), r"p.json describes another dataset \(dtype int32"),
])
def test_a_malformed_sidecar_is_one_line_naming_file_and_field(tmp_path, change, match):
    prefix = _prepared(tmp_path, change)
    with pytest.raises(ValueError, match=match) as e:
        check_source(open_source(prefix, ByteTokenizer()), 257, ByteTokenizer(), 8, "--data")
    message = str(e.value)
    assert "\n" not in message and "p.json" in message and ("delete" in message or "prepare" in message)
    (tmp_path / "p.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="p.json must hold a JSON object"):
        open_source(prefix, ByteTokenizer())


def test_a_sidecar_that_understates_max_id_never_lets_a_wrong_id_through(tmp_path, monkeypatch):
    """The ids are 0..299 (int32, as a 300-id tokenizer's data), the sidecar claims max_id 3: a small dataset is
    scanned before launch; a large one (here: every dataset counts as large) is stopped at its first sample."""
    from torchtsp.data import sources

    ids = np.arange(300 * 4) % 300
    write_megatron(tmp_path / "p", [ids[i:i + 100].tolist() for i in range(0, ids.size, 100)], 4)
    (tmp_path / "p.json").write_text(json.dumps({"tokens": int(ids.size), "max_id": 3, "dtype": "int32"}))
    source = open_source(str(tmp_path / "p"), ByteTokenizer())
    with pytest.raises(ValueError, match="holds token id 299, outside the model's vocabulary of 257"):
        check_source(source, 257, ByteTokenizer(), 8, "--data")
    monkeypatch.setattr(sources, "SCAN_BYTES", 0)
    check_source(open_source(str(tmp_path / "p"), ByteTokenizer()), 257, ByteTokenizer(), 8, "--data")
    samples = PackedSamples(source, 8, vocab_size=257)
    assert samples.sample(0).tolist() == list(range(9))
    with pytest.raises(ValueError, match=r"p holds token id 26\d \(at token 26\d\), outside the model's vocab"):
        BatchStream([(1.0, samples)], len(samples), shuffle=False).next_batch()


@pytest.mark.parametrize("spec", ["", "   "])
def test_an_empty_path_is_never_the_current_folder(tmp_path, monkeypatch, spec):
    from torchtsp.data.documents import input_files
    from torchtsp.data.tokenizers import load_tokenizer
    from torchtsp.train.config import TrainConfig

    monkeypatch.chdir(tmp_path)  # Path("") would be this folder: its text must never be read
    (tmp_path / "private.txt").write_text("a text that must not be trained on")
    (tmp_path / "tokenizer.json").write_text("{}")
    text = tmp_path / "private.txt"
    for call in (lambda: parse_blend(spec), lambda: open_source(spec, ByteTokenizer()),
                 lambda: input_files([spec]), lambda: load_tokenizer(spec), lambda: HFTokenizer(spec),
                 lambda: prepare([spec], "byte", str(tmp_path / "o"), progress=False),
                 lambda: prepare([text], "byte", spec, progress=False),
                 lambda: prepare([text], spec, str(tmp_path / "o"), progress=False)):
        with pytest.raises(ValueError, match="empty"):
            call()
    for field in ("data", "eval_data", "tokenizer", "init_from_hf", "resume", "out"):
        with pytest.raises(ValueError, match=f"{field} .* is an empty path"):
            TrainConfig(**{field: spec})
    with pytest.raises(ValueError, match="--eval-data is empty"):
        parse_blend(" ", "--eval-data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["private.txt", "tokenizer.json"]


@pytest.mark.parametrize("content,where", [
    (b'{"text": "fine"}\n{"text": "caf\xff"}\n', r"bad.jsonl:2: byte 0xff at byte offset 30 is not UTF-8"),
    (b'{"text": "fine"}\n\n{"text": "\xe9t\xe9"}\n', r"bad.jsonl:3: byte 0xe9 at byte offset 28 is not UTF-8"),
    (b'{"text": "fine"}\n{"text": "\\ud800"}\n', r"bad.jsonl:2: the text holds '\\ud800' \(a lone surrogate\)"),
    (b'{"text": "fine"}\n' + b"[" * 100_000 + b"\n", r"bad.jsonl:2: not a JSON object \(nested too deeply"),
])
def test_bad_bytes_in_jsonl_name_file_line_and_offset(bpe_dir, tmp_path, content, where):
    (tmp_path / "bad.jsonl").write_bytes(content)
    for read in (lambda: open_source(str(tmp_path / "bad.jsonl"), ByteTokenizer()),
                 lambda: prepare([tmp_path / "bad.jsonl"], str(bpe_dir), str(tmp_path / "out"), progress=False)):
        with pytest.raises(ValueError, match=where) as e:
            read()
        assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_a_jsonl_with_a_byte_order_mark_is_read(tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + b'{"text": "ab"}\n{"text": "c"}\n')
    assert open_source(str(tmp_path / "bom.jsonl"), ByteTokenizer()).tokens.tolist() == [97, 98, 256, 99, 256]


def test_bad_bytes_in_text_and_parquet_name_file_and_place(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "notes.md").write_bytes("line one\nligne deux: é\n".encode() + b"trois: \xe9t\xe9\n")
    with pytest.raises(ValueError, match=r"notes.md:3: byte 0xe9 at byte offset 31 is not UTF-8 \(invalid cont"):
        open_source(str(tmp_path / "notes.md"), ByteTokenizer())
    pq.write_table(pa.table({"text": pa.array([b"ok", b"\xff"], pa.binary())}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b.parquet: row 0 of column 'text' holds bytes, not text"):
        open_source(str(tmp_path / "b.parquet"), ByteTokenizer())
    offsets = pa.py_buffer(np.array([0, 2, 5], np.int32).tobytes())  # "ok", then 3 bytes that are not UTF-8
    bad = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"ok" + b"a\xffb")])
    pq.write_table(pa.table({"text": bad}), tmp_path / "u.parquet")
    with pytest.raises(ValueError, match=r"u.parquet: row 1: byte 0xff at byte offset 1 is not UTF-8"):
        open_source(str(tmp_path / "u.parquet"), ByteTokenizer())
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"n.parquet: row 0 of column 'text' holds int, not text"):
        open_source(str(tmp_path / "n.parquet"), ByteTokenizer())
