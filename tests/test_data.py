import json

import numpy as np
import pytest
import torch

from lm.data import TokenDataset, get_batch, read_token_file, write_token_file
from lm.data.batch import batch_at
from lm.data.token_file import max_token_id


def test_token_file_round_trip(tmp_path):
    ids = np.arange(1000) % 300
    meta = write_token_file(tmp_path / "a.bin", ids, vocab_size=300, source_bytes=4000, tokenizer_sha256="ab")
    tokens, read_meta = read_token_file(tmp_path / "a.bin")
    assert isinstance(tokens, np.memmap)
    assert tokens.dtype == np.uint16
    np.testing.assert_array_equal(tokens, ids)
    assert read_meta == meta
    assert meta["num_tokens"] == 1000 and meta["source_bytes"] == 4000
    assert (tmp_path / "a.bin").stat().st_size == 2000
    assert json.loads((tmp_path / "a.bin.json").read_text())["format"] == "lm-tokens"


def test_token_file_uint32_and_chunks(tmp_path):
    chunks = [np.array([70000, 1]), np.array([], dtype=np.int64), np.array([99999])]
    meta = write_token_file(tmp_path / "b.bin", iter(chunks), vocab_size=100000)
    tokens, _ = read_token_file(tmp_path / "b.bin")
    assert meta["dtype"] == "uint32" and tokens.dtype == np.uint32
    np.testing.assert_array_equal(tokens, [70000, 1, 99999])
    assert max_token_id(tmp_path / "b.bin", tokens.dtype, chunk=2) == 99999


@pytest.mark.parametrize("form", ["list", "tuple", "range", "tensor", "tensor2d", "ids_stream", "lists", "mixed"])
def test_a_list_or_tensor_of_ids_is_one_array(tmp_path, monkeypatch, form):
    """A list of ints or a tensor had been taken as an iterable of chunks: one check and one write
    per id (60x slower than the array). Each form writes the array's bytes, in a few writes."""
    import lm.data.token_file as tf

    n = 20_000
    ids = np.arange(n) % 70_000
    write_token_file(tmp_path / "ref.bin", ids, vocab_size=70_000)
    given = {
        "list": ids.tolist(), "tuple": tuple(ids.tolist()), "range": range(n), "tensor": torch.arange(n),
        "tensor2d": torch.arange(n).reshape(100, -1),
        "ids_stream": (int(i) for i in ids),  # as Tokenizer.encode_iterable yields them
        "lists": [ids[:7].tolist(), ids[7:].tolist()],  # a list of chunks stays a list of chunks
        "mixed": iter([ids[:5], 5, 6, np.array([7]), *ids[8:].tolist()]),
    }[form]
    calls = []
    check = tf.check_ids
    monkeypatch.setattr(tf, "check_ids", lambda chunk, vocab: calls.append(1) or check(chunk, vocab))
    meta = write_token_file(tmp_path / "x.bin", given, vocab_size=70_000)
    assert meta["num_tokens"] == n and (tmp_path / "x.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert len(calls) <= 4, len(calls)


def test_a_list_of_ids_and_arrays_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds either ids or arrays of ids, not both"):
        write_token_file(tmp_path / "x.bin", [1, np.array([2, 3])], vocab_size=10)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ids, bad", [([1, 300], 300), ([0, 300], 300), ([-1, 5], -1), ([-2, 0, 301], -2)])
def test_write_rejects_ids_outside_vocab_and_leaves_nothing(tmp_path, ids, bad):
    """The id named is one outside the vocabulary (the lowest when one is negative), never the
    in-range 0 beside a too-large one."""
    with pytest.raises(ValueError) as e:
        write_token_file(tmp_path / "c.bin", np.array(ids), vocab_size=300)
    assert str(e.value) == f"token id {bad} is outside the vocabulary [0, 300)"
    assert list(tmp_path.iterdir()) == []


def test_a_token_files_sidecar_records_no_source_unless_given_and_a_folder_has_no_sidecar_name(tmp_path):
    from lm.data.token_file import sidecar_path

    assert write_token_file(tmp_path / "c.bin", np.arange(3), vocab_size=10)["source"] == ""
    assert json.loads((tmp_path / "c.bin.json").read_text())["source"] == ""
    assert sidecar_path(tmp_path / "c.bin") == tmp_path / "c.bin.json"
    for name in (".", "/"):
        with pytest.raises(ValueError) as e:
            sidecar_path(name)
        assert str(e.value) == f"{name!r} is a folder, not a token or pair file"


def _interrupting(chunks, at):
    """Yield ``chunks``, delivering a real SIGINT to this process after the chunk numbered ``at``."""
    import signal

    for i, chunk in enumerate(chunks):
        yield chunk
        if i == at:
            signal.raise_signal(signal.SIGINT)


def test_ctrl_c_while_writing_ids_leaves_nothing(tmp_path):
    chunks = [np.arange(10), np.arange(10, 20), np.arange(20, 30)]
    with pytest.raises(KeyboardInterrupt):
        write_token_file(tmp_path / "c.bin", _interrupting(chunks, 0), vocab_size=100)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_once_ids_are_written_waits_for_the_sidecar(tmp_path, monkeypatch):
    """The interrupt that lands between the ids' rename and the sidecar's waits, then is raised:
    the ids and the sidecar are both the new ones (before, the ids were new and the sidecar old)."""
    import signal

    import lm.data.token_file as tf

    path = tmp_path / "c.bin"
    write_token_file(path, np.arange(5), vocab_size=100)  # an earlier output, with its sidecar
    real = json.dump

    def interrupted_before_sidecar(*a, **k):
        signal.raise_signal(signal.SIGINT)  # the ids are written; the sidecar is not yet
        return real(*a, **k)

    monkeypatch.setattr(tf.json, "dump", interrupted_before_sidecar)
    with pytest.raises(KeyboardInterrupt):
        write_token_file(path, np.arange(30), vocab_size=100)
    ids, meta = read_token_file(path)
    assert meta["num_tokens"] == 30 and np.array_equal(ids, np.arange(30))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
    assert sorted(q.name for q in tmp_path.iterdir()) == ["c.bin", "c.bin.json"]


def test_a_failed_sidecar_write_leaves_the_earlier_token_file_whole(tmp_path, monkeypatch):
    """The ids were renamed into place before the sidecar was written: a failure at the sidecar (a
    full disk) left the new ids beside the old sidecar, the earlier output lost (clifuzz7 #1). Now
    both are written before either is renamed, and no temporary file is left."""
    import errno

    import lm.data.token_file as tf

    path = tmp_path / "c.bin"
    write_token_file(path, np.arange(5), vocab_size=100, source="old.txt")
    before = {q.name: q.read_bytes() for q in tmp_path.iterdir()}

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tf.json, "dump", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        write_token_file(path, np.arange(30), vocab_size=100)
    assert {q.name: q.read_bytes() for q in tmp_path.iterdir()} == before


def test_a_source_name_that_is_not_utf8_is_stored_as_escapes(tmp_path):
    """A Latin-1 file name (a lone surrogate in Python) was stored as the JSON escape "\\udcff", which
    reads back as a string no UTF-8 file or terminal can hold; it is stored as "\\xff" (clifuzz7 #1)."""
    meta = write_token_file(tmp_path / "c.bin", np.arange(5), vocab_size=100, source="caf\udce9.txt")
    assert meta["source"] == "caf\\xe9.txt"
    assert read_token_file(tmp_path / "c.bin")[1]["source"] == "caf\\xe9.txt"
    assert b'"source": "caf\\\\xe9.txt"' in (tmp_path / "c.bin.json").read_bytes()


@pytest.mark.parametrize("name", [".", "/", "..", "folder"])
def test_a_folder_given_as_a_token_file_is_named_as_one(tmp_path, monkeypatch, name):
    """`--set data.train=.` said "data.train: PosixPath('.') has an empty name" (Path.with_name);
    '..' and other folders "token file not found" (clifuzz7 #12)."""
    from lm.data.pairs import read_pair_meta
    from lm.data.token_file import read_token_meta

    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError) as e:
        read_token_meta(name)
    assert str(e.value) == f"{name!r} is a folder, not a token file"
    with pytest.raises(ValueError) as e:
        read_pair_meta(name)
    assert str(e.value) == f"{name!r} is a folder, not a pair file"


def _bad_file(tmp_path, mutate):
    path = tmp_path / "d.bin"
    write_token_file(path, np.arange(100), vocab_size=100)
    side = tmp_path / "d.bin.json"
    meta = json.loads(side.read_text())
    mutate(path, side, meta)
    return path


def _sidecar(**changes):
    return lambda p, s, m: s.write_text(json.dumps({**m, **changes}))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p, s, m: p.unlink(), "token file not found: {p}"),
        (lambda p, s, m: s.unlink(), "{p} has no sidecar 'd.bin.json'; write token files with `lm tokenize`"),
        (lambda p, s, m: s.write_text("{not json"), "sidecar {s} is not valid JSON: Expecting property name enclosed "
                                                    "in double quotes: line 1 column 2 (char 1)"),
        (_sidecar(format="x"), "sidecar {s} is not an 'lm-tokens' sidecar"),
        (_sidecar(version=2), "sidecar {s} has version 2; this lm reads 1"),
        (_sidecar(dtype="uint32"), "sidecar {s}: dtype 'uint32' does not match vocab_size 100 (expected 'uint16')"),
        (_sidecar(dtype="int8"), "sidecar {s}: dtype 'int8' is not one of ['uint16', 'uint32']"),
        (_sidecar(num_tokens="100"), "sidecar {s}: 'num_tokens' is missing or not an integer"),
        (_sidecar(dtype=16), "sidecar {s}: 'dtype' is missing or not a string"),
        (_sidecar(num_tokens=-1), "sidecar {s}: vocab_size must be positive and num_tokens must not be negative"),
        (_sidecar(vocab_size=0), "sidecar {s}: vocab_size must be positive and num_tokens must not be negative"),
        (lambda p, s, m: p.write_bytes(p.read_bytes()[:-3]),
         "{p} has 197 bytes but its sidecar says 100 uint16 ids (200 bytes): the file is truncated or not the one the "
         "sidecar describes"),
    ],
)
def test_read_rejects_bad_sidecar_or_file(tmp_path, mutate, message):
    path = _bad_file(tmp_path, mutate)
    with pytest.raises(ValueError) as e:
        read_token_file(path)
    assert str(e.value) == message.format(p=repr(str(path)), s=repr(str(path) + ".json"))


def test_a_token_file_of_no_ids_reads_as_such_and_is_refused_for_training(tmp_path):
    """Zero ids is a valid count (an empty corpus writes one): its sidecar reads, and a dataset is
    refused because it is empty, not for a count the sidecar holds rightly."""
    from lm.data.token_file import read_token_meta

    write_token_file(tmp_path / "e.bin", np.array([], dtype=np.int64), vocab_size=100)
    assert read_token_meta(tmp_path / "e.bin")["num_tokens"] == 0
    # an empty list or tuple, or a list of no arrays, is no ids either (mutation: an empty list taken
    # for one array and its first item read, survived)
    for i, empty in enumerate(([], (), [[]], iter([]))):
        assert write_token_file(tmp_path / f"e{i}.bin", empty, vocab_size=100)["num_tokens"] == 0
        assert (tmp_path / f"e{i}.bin").stat().st_size == 0
    with pytest.raises(ValueError) as e:
        read_token_file(tmp_path / "e.bin")
    assert str(e.value) == f"token file {str(tmp_path / 'e.bin')!r} is empty"


def test_a_token_file_is_mapped_read_only_and_a_vocabulary_of_one_id_is_one(tmp_path):
    """read_token_file never opens the user's data for writing: a slip in a batch function cannot
    change the corpus on disk. A vocabulary of one id is the smallest, not refused."""
    write_token_file(tmp_path / "one.bin", np.zeros(5, dtype=np.int64), vocab_size=1)
    tokens, meta = read_token_file(tmp_path / "one.bin")
    assert (meta["vocab_size"], meta["dtype"], tokens.tolist()) == (1, "uint16", [0] * 5)
    assert not tokens.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        tokens[0] = 3


def test_get_batch_shapes_targets_and_range():
    data = np.arange(50, dtype=np.uint16)
    x, y = get_batch(data, 64, 8, "cpu", generator=np.random.default_rng(0))
    assert x.shape == y.shape == (64, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # consecutive ids: the target is the next token
    assert int(x[:, 0].min()) >= 0 and int(y[:, -1].max()) <= 49


def test_get_batch_starts_are_uniform():
    data = np.arange(20)
    x, _ = get_batch(data, 20000, 5, "cpu", generator=np.random.default_rng(1))
    counts = np.bincount(x[:, 0].numpy(), minlength=15)
    assert len(counts) == 15  # every start 0..14 and none past it
    assert counts.min() > 1100 and counts.max() < 1570  # ~1333 each


def test_get_batch_refuses_bad_arguments():
    """context_length -5 gave empty (2, 0) tensors, a 2-D dataset (2, 3, 10) ones, batch_size 0 an
    error from np.stack: each a ValueError naming the argument. Good ones give the windows at the
    generator's starts, as before."""
    data = np.arange(100)
    for kwargs, match in (
        ({"context_length": -5}, "context_length must be a positive integer, got context_length=-5"),
        ({"context_length": 0}, "context_length=0"),
        ({"context_length": 2.0}, "context_length=2.0"),
        ({"batch_size": 0}, "batch_size must be a positive integer, got batch_size=0"),
        ({"batch_size": -1}, "batch_size=-1"),
        ({"dataset": data.reshape(10, 10)}, "dataset must be a 1-D array of token ids, got 2 dimensions"),
        ({"dataset": np.arange(8)}, "it needs more than context_length=8"),
    ):
        args = {"dataset": data, "batch_size": 2, "context_length": 8, **kwargs}
        with pytest.raises(ValueError, match=match):
            get_batch(args["dataset"], args["batch_size"], args["context_length"], "cpu")
    with pytest.raises(ValueError, match=r"starts must be in \[0, 91\] .* got start 92"):
        batch_at(data, np.array([0, 92]), 8, "cpu")
    with pytest.raises(ValueError, match="got start -1"):
        batch_at(data, np.array([-1]), 8, "cpu")
    with pytest.raises(ValueError, match="starts must be a non-empty 1-D array"):
        batch_at(data, np.array([], dtype=np.int64), 8, "cpu")
    x, y = get_batch(data, 3, 8, "cpu", generator=np.random.default_rng(4))
    starts = np.random.default_rng(4).integers(0, 92, size=3)
    assert torch.equal(x, torch.from_numpy(starts[:, None] + np.arange(8))) and torch.equal(y, x + 1)
    assert np.array_equal(batch_at(data, np.array([91]), 8, "cpu")[1][0].numpy(), np.arange(92, 100))


def test_dataset_refuses_bad_context_rank_and_batch_size(tmp_path):
    """context_length 0 or -1 and a rank outside [0, world_size) were accepted (the latter sampled
    empty batches)."""
    write_token_file(tmp_path / "t.bin", np.arange(100) % 50, vocab_size=64)
    path = tmp_path / "t.bin"
    for kwargs, match in (
        ({"context_length": 0}, "context_length must be a positive integer, got context_length=0"),
        ({"context_length": -1}, "context_length=-1"),
        ({"rank": 2, "world_size": 2}, r"rank must be an integer in \[0, world_size=2\), got rank=2"),
        ({"rank": -1, "world_size": 2}, "rank=-1"),
        ({"world_size": 0}, "world_size must be a positive integer, got world_size=0"),
    ):
        args = {"context_length": 8, **kwargs}
        with pytest.raises(ValueError, match=match):
            TokenDataset(path, args.pop("context_length"), **args)
    for seed in (-1, 2**64, 1.5, True):  # numpy's "expected non-negative integer" named neither
        with pytest.raises(ValueError) as e:
            TokenDataset(path, 8, seed=seed)
        assert str(e.value) == f"seed: must be a whole number in [0, 2**64-1], got {seed!r}"
        with pytest.raises(ValueError) as e:
            TokenDataset(path, 8).fixed_batches(2, 3, seed=seed)
        assert str(e.value) == f"seed: must be a whole number in [0, 2**64-1], got {seed!r}"
    assert TokenDataset(path, 8, seed=np.uint64(2**64 - 1)).sample(1, "cpu")[0].shape == (1, 8)
    ds = TokenDataset(path, 8, rank=1, world_size=2)
    for batch_size in (0, -2):
        with pytest.raises(ValueError, match=f"batch_size must be a positive integer, got batch_size={batch_size}"):
            ds.sample(batch_size, "cpu")
    assert ds.sample(2, "cpu")[0].shape == (2, 8)


def test_dataset_checks_vocab_and_length(tmp_path):
    write_token_file(tmp_path / "t.bin", np.arange(100) % 50, vocab_size=64)
    with pytest.raises(ValueError, match="vocab_size 64, larger than the model's vocab_size 32"):
        TokenDataset(tmp_path / "t.bin", 8, vocab_size=32)
    write_token_file(tmp_path / "u.bin", np.array([1, 2, 49, 3]), vocab_size=50)
    with pytest.raises(ValueError) as refused:
        TokenDataset(tmp_path / "u.bin", 4, vocab_size=50)
    # (mutation: "context_length + 1 = 3", survived)
    assert str(refused.value) == f"{str(tmp_path / 'u.bin')!r} has 4 tokens, fewer than context_length + 1 = 5"
    TokenDataset(tmp_path / "u.bin", 3, vocab_size=50)


def test_dataset_finds_ids_beyond_model_vocab(tmp_path):
    # The sidecar claims a 40-id vocabulary but the file holds id 45: the scan catches it.
    path = tmp_path / "v.bin"
    write_token_file(path, np.array([1, 2, 3, 45, 5, 6]), vocab_size=50)
    side = tmp_path / "v.bin.json"
    side.write_text(json.dumps({**json.loads(side.read_text()), "vocab_size": 40}))
    with pytest.raises(ValueError, match="contains token id 45, outside the model's vocabulary"):
        TokenDataset(path, 2, vocab_size=40)


def test_dataset_state_resumes_the_same_batches(tmp_path):
    write_token_file(tmp_path / "t.bin", np.arange(5000) % 1000, vocab_size=1000)
    ds = TokenDataset(tmp_path / "t.bin", 16, vocab_size=1000, seed=3)
    ds.sample(4, "cpu")
    state = ds.state_dict()
    expected = [ds.sample(4, "cpu")[0] for _ in range(3)]
    again = TokenDataset(tmp_path / "t.bin", 16, vocab_size=1000, seed=99)
    again.load_state_dict(state)
    for want in expected:
        assert torch.equal(again.sample(4, "cpu")[0], want)


def test_ranks_split_one_global_batch(tmp_path):
    write_token_file(tmp_path / "t.bin", np.arange(5000) % 1000, vocab_size=1000)
    single = TokenDataset(tmp_path / "t.bin", 16, seed=7)
    ranks = [TokenDataset(tmp_path / "t.bin", 16, seed=7, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        x, _ = single.sample(6, "cpu")
        parts = [r.sample(3, "cpu")[0] for r in ranks]
        assert not torch.equal(parts[0], parts[1])
        assert torch.equal(torch.cat(parts), x)
    evals = [r.fixed_batches(2, 3, seed=5) for r in ranks]
    assert np.array_equal(np.concatenate([evals[0][1], evals[1][1]]), single.fixed_batches(2, 6, seed=5)[1])
    assert np.array_equal(evals[0][0], ranks[0].fixed_batches(2, 3, seed=5)[0])


def test_dataset_windows_read_the_file(tmp_path):
    ids = (np.arange(3000) * 7) % 1000
    write_token_file(tmp_path / "t.bin", ids, vocab_size=1000)
    ds = TokenDataset(tmp_path / "t.bin", 16, vocab_size=1000)
    starts = np.array([0, 5, 3000 - 17])
    np.testing.assert_array_equal(ds.windows(starts), np.stack([ids[s : s + 17] for s in starts]))
    x, y = ds.batch(starts, "cpu")
    assert torch.equal(x, torch.from_numpy(np.stack([ids[s : s + 16] for s in starts])))
    assert torch.equal(y, torch.from_numpy(np.stack([ids[s + 1 : s + 17] for s in starts])))


@pytest.mark.parametrize("field, value, message", [
    ("source_bytes", "x", "'source_bytes' must be a non-negative integer, got 'x'"),
    ("source_bytes", 1.5, "'source_bytes' must be a non-negative integer, got 1.5"),
    ("source_bytes", False, "'source_bytes' must be a non-negative integer, got False"),
    ("tokenizer_sha256", 5, "'tokenizer_sha256' must be a string, got 5"),
    ("source", ["a"], "'source' must be a string, got ['a']"),
])
def test_a_sidecar_field_of_the_wrong_type_is_one_line(tmp_path, field, value, message):
    """``source_bytes: "x"`` or ``tokenizer_sha256: 5`` passed the checks and then stopped `lm train`
    and `lm eval` with a TypeError traceback (audit data4 #2): now the reader names sidecar and field."""
    path = _bad_file(tmp_path, lambda p, s, m: s.write_text(json.dumps({**m, field: value})))
    with pytest.raises(ValueError) as e:
        read_token_file(path)
    assert str(e.value) == f"sidecar {str(tmp_path / 'd.bin.json')!r}: {message}"
    path = _bad_file(tmp_path, lambda p, s, m: s.write_text(json.dumps(
        {k: v for k, v in m.items() if k not in ("source_bytes", "tokenizer_sha256", "source")})))
    meta = read_token_file(path)[1]  # missing ones are the defaults, as before
    assert (meta["source_bytes"], meta["tokenizer_sha256"], meta["source"]) == (0, "", "")


@pytest.mark.parametrize("dataset, dtype", [
    (np.linspace(0, 5, 10), "float64"), (torch.linspace(0, 5, 10), "torch.float32"),
    (np.arange(10) > 3, "bool"), (torch.arange(10) > 3, "torch.bool"), ([0.5] * 10, "float64"),
])
def test_get_batch_refuses_ids_that_are_not_integers(dataset, dtype):
    """A float array was truncated into "ids" (0.55 -> 0) and gave a batch (audit data4 #6)."""
    for call in (lambda: get_batch(dataset, 1, 3, "cpu"), lambda: batch_at(dataset, np.array([0]), 3, "cpu")):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == f"dataset: token ids must be integers, got dtype {dtype}"
    for ids in (np.arange(10, dtype=np.uint16), torch.arange(10, dtype=torch.int32), list(range(10))):
        x, y = get_batch(ids, 2, 3, "cpu")
        assert x.dtype == torch.int64 and torch.equal(y, x + 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"vocab_size": 2**40},
     "vocab_size must be at most 2**32 (ids are stored as uint32), got vocab_size=1099511627776"),
    ({"vocab_size": 99.5}, "vocab_size must be a positive integer, got vocab_size=99.5"),
    ({"vocab_size": 100.0}, "vocab_size must be a positive integer, got vocab_size=100.0"),
    ({"vocab_size": True}, "vocab_size must be a positive integer, got vocab_size=True"),
    ({"source_bytes": 2.9}, "source_bytes must be a non-negative integer or None, got source_bytes=2.9"),
    ({"source_bytes": "12"}, "source_bytes must be a non-negative integer or None, got source_bytes='12'"),
    ({"source_bytes": -5}, "source_bytes must be a non-negative integer or None, got source_bytes=-5"),
    ({"tokenizer_sha256": 5}, "tokenizer_sha256 must be a str or None, got tokenizer_sha256=5"),
])
def test_write_token_file_checks_its_arguments_and_writes_nothing(tmp_path, kwargs, message):
    """vocab_size, source_bytes and tokenizer_sha256 had been cast with int() and str(): a vocab of
    2**40 wrapped id 2**32 + 7 to 7, 99.5 was recorded as 99 over a file holding id 99, source_bytes
    2.9 as 2, and -5 written into a file the reader then refused (apifuzz19 #9)."""
    args = {"vocab_size": 100, **kwargs}
    with pytest.raises(ValueError) as e:
        write_token_file(tmp_path / "a.bin", np.arange(6), **args)
    assert str(e.value) == message
    assert list(tmp_path.iterdir()) == []


def test_write_token_file_keeps_valid_arguments_and_none_is_not_known(tmp_path):
    meta = write_token_file(tmp_path / "a.bin", np.arange(6), vocab_size=np.int64(100), source_bytes=np.int32(12),
                            tokenizer_sha256=None)
    assert (meta["vocab_size"], meta["source_bytes"], meta["tokenizer_sha256"]) == (100, 12, "")  # not 'None'
    assert type(meta["vocab_size"]) is int and read_token_file(tmp_path / "a.bin")[1] == meta
    assert write_token_file(tmp_path / "b.bin", np.arange(6), vocab_size=100, source_bytes=None)["source_bytes"] == 0
    meta = write_token_file(tmp_path / "c.bin", np.array([2**32 - 1, 3]), vocab_size=2**32)  # the widest that fits
    assert meta["dtype"] == "uint32" and read_token_file(tmp_path / "c.bin")[0].tolist() == [2**32 - 1, 3]


def test_write_token_file_refuses_the_sidecar_of_a_token_file(tmp_path):
    """Writing to ``ok.bin.json`` put raw ids over ok.bin's sidecar, and ok.bin no longer read (apifuzz19 #9)."""
    write_token_file(tmp_path / "ok.bin", np.arange(50), vocab_size=100)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError) as e:
        write_token_file(tmp_path / "ok.bin.json", np.arange(6), vocab_size=100)
    side = str(tmp_path / "ok.bin.json")
    assert str(e.value) == f"path: {side!r} is the sidecar of the token file {str(tmp_path / 'ok.bin')!r}; " \
                           "choose another output"
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert read_token_file(tmp_path / "ok.bin")[1]["num_tokens"] == 50
    (tmp_path / "notes.json").write_text("{}")  # a .json that is no sidecar may be written over, as before
    assert write_token_file(tmp_path / "notes.json", np.arange(6), vocab_size=100)["num_tokens"] == 6


def test_dataset_batch_refuses_starts_that_are_not_windows(tmp_path):
    """A float start was truncated (1.5 read from 1), one past the end was "a short read: was the file
    changed during training?", and -1 an OSError "Invalid argument" (apifuzz19 #11)."""
    write_token_file(tmp_path / "t.bin", np.arange(100) % 50, vocab_size=100)
    ds = TokenDataset(tmp_path / "t.bin", 8)
    for starts, message in (
        (np.array([1.5]), "starts must be integers, got dtype float64"),
        (np.array([95]), "starts must be in [0, 91] for windows of context_length=8 in 100 ids, got start 95"),
        (np.array([3, 92]), "starts must be in [0, 91] for windows of context_length=8 in 100 ids, got start 92"),
        (np.array([-1]), "starts must be in [0, 91] for windows of context_length=8 in 100 ids, got start -1"),
        (np.array([[1]]), "starts must be a 1-D array of positions, got shape (1, 1)"),
    ):
        with pytest.raises(ValueError) as e:
            ds.batch(starts, "cpu")
        assert str(e.value) == message
    x, y = ds.batch(np.array([0, 91], dtype=np.uint32), "cpu")  # the ends of the range, any integer dtype
    assert x[1].tolist() == [41, 42, 43, 44, 45, 46, 47, 48] and y[1, -1].item() == 49
    assert ds.batch([5], "cpu")[0].tolist() == [list(range(5, 13))]


def test_dataset_fixed_batches_and_load_state_dict_refuse_bad_arguments(tmp_path):
    """fixed_batches(-1, ...) returned [] and 1.5 raised range()'s TypeError; load_state_dict({'x': 1})
    a KeyError 'generator' (apifuzz19 #11)."""
    write_token_file(tmp_path / "t.bin", np.arange(100) % 50, vocab_size=100)
    ds = TokenDataset(tmp_path / "t.bin", 8)
    for count in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError) as e:
            ds.fixed_batches(count, 2, 0)
        assert str(e.value) == f"num_batches must be a non-negative integer, got num_batches={count!r}"
    assert ds.fixed_batches(0, 2, 0) == [] and len(ds.fixed_batches(np.int64(3), 2, 0)) == 3
    state = ds.state_dict()
    for bad, message in (
        ({"x": 1}, "state must be a TokenDataset.state_dict() (a dict with 'generator'), got a dict with keys ['x']"),
        (None, "state must be a TokenDataset.state_dict() (a dict with 'generator'), got None"),
        ({"generator": {"bit_generator": "MT19937"}},
         "state: 'generator' is not a PCG64 generator state (state must be for a PCG64 RNG)"),
        ({"generator": {"bit_generator": "PCG64", "state": {"state": 1}}},
         "state: 'generator' is not a PCG64 generator state (no key 'inc')"),
    ):
        with pytest.raises(ValueError) as e:
            ds.load_state_dict(bad)
        assert str(e.value) == message
    assert ds.state_dict() == state  # unchanged by the refused states
    ds.load_state_dict(state)


def test_get_batch_and_the_dataset_take_a_numpy_generator_only(tmp_path):
    """get_batch(..., generator=torch.Generator()) failed with "'torch._C.Generator' object has no
    attribute 'integers'" (apifuzz19 #21): the parameter is a NumPy Generator, which the error now says."""
    data = np.arange(100)
    write_token_file(tmp_path / "t.bin", data % 50, vocab_size=64)
    ds = TokenDataset(tmp_path / "t.bin", 8)
    for bad in (torch.Generator(), 0, np.random.RandomState(0)):
        with pytest.raises(ValueError, match=r"^generator must be a NumPy Generator \(np.random.default_rng\(seed\)\) "
                                             r"or None, got generator="):
            get_batch(data, 2, 8, "cpu", generator=bad)
        with pytest.raises(ValueError, match=r"^generator must be a NumPy Generator"):
            ds.global_starts(2, bad)
    x, y = get_batch(data, 2, 8, "cpu", generator=np.random.default_rng(0))
    x2, _ = get_batch(data, 2, 8, "cpu", generator=np.random.default_rng(0))
    assert x.shape == (2, 8) and torch.equal(x, x2) and torch.equal(y[:, :-1], x[:, 1:])


@pytest.mark.parametrize("vocab_size", ["100", -1, 0, 64.0, True])
def test_dataset_vocab_size_must_be_a_positive_integer(tmp_path, vocab_size):
    """vocab_size='100' raised "'>' not supported", and -1 or 0 said the file's vocabulary was larger
    than "the model's vocab_size -1" (apifuzz19 #21)."""
    write_token_file(tmp_path / "t.bin", np.arange(100) % 50, vocab_size=64)
    with pytest.raises(ValueError, match=rf"^vocab_size must be a positive integer, got vocab_size={vocab_size!r}$"):
        TokenDataset(tmp_path / "t.bin", 8, vocab_size=vocab_size)
    assert TokenDataset(tmp_path / "t.bin", 8, vocab_size=np.int64(64)).context_length == 8


def test_the_token_datasets_starts_are_uniform_up_to_the_last_window(tmp_path):
    """As test_get_batch_starts_are_uniform, for what the trainer samples: every start 0..14 of a
    20-id file with context 5 is drawn (the last one too), about equally often."""
    write_token_file(tmp_path / "t.bin", np.arange(20), vocab_size=32)
    ds = TokenDataset(tmp_path / "t.bin", 5, seed=1)
    x = torch.cat([ds.sample(1000, "cpu")[0] for _ in range(20)])
    counts = np.bincount(x[:, 0].numpy(), minlength=15)
    assert len(counts) == 15 and counts.min() > 1100 and counts.max() < 1570  # ~1333 each
    starts = np.concatenate(ds.fixed_batches(20, 1000, seed=2))
    counts = np.bincount(starts, minlength=15)
    assert len(counts) == 15 and counts.min() > 1100 and counts.max() < 1570


def test_get_batch_without_a_generator_draws_every_start():
    """get_batch with numpy's global random state (no generator): the same range as with one."""
    np.random.seed(1)
    x, _ = get_batch(np.arange(20), 20000, 5, "cpu")
    counts = np.bincount(x[:, 0].numpy(), minlength=15)
    assert len(counts) == 15 and counts.min() > 1100 and counts.max() < 1570


def test_fixed_validation_batches_are_distinct_draws_and_the_same_at_every_call(tmp_path):
    """eval.batches validation batches: that many different batches (the same batch N times would
    measure the loss on 1/N of the windows), the same at every call and whatever was sampled."""
    write_token_file(tmp_path / "t.bin", np.arange(5000) % 1000, vocab_size=1000)
    ds = TokenDataset(tmp_path / "t.bin", 16, seed=0)
    first = ds.fixed_batches(8, 4, seed=3)
    assert len({tuple(b.tolist()) for b in first}) == 8
    ds.sample(4, "cpu")
    assert all(np.array_equal(a, b) for a, b in zip(first, ds.fixed_batches(8, 4, seed=3)))


# F4: a token file longer than its sidecar says is refused (not read as its first num_tokens ids)
def test_a_token_file_longer_than_its_sidecar_says_is_refused(tmp_path):
    from lm.data.token_file import read_token_file, write_token_file

    p = tmp_path / "t.bin"
    write_token_file(p, np.arange(10), vocab_size=100)
    with open(p, "ab") as f:  # the ids of another write beside this sidecar (a cut between renames), or appended
        f.write(np.arange(10, dtype="<u2").tobytes())
    with pytest.raises(ValueError, match="has 40 bytes but its sidecar says 10 uint16 ids"):
        read_token_file(p)


# F9: a stream of single ids longer than one block is written whole
def test_a_stream_of_single_ids_longer_than_a_block_is_written_whole(tmp_path, monkeypatch):
    import lm.data.token_file as tf

    monkeypatch.setattr(tf, "_SCAN_CHUNK", 7)
    ids = list(range(50))
    meta = tf.write_token_file(tmp_path / "t.bin", iter(ids), vocab_size=100)
    tokens, _ = tf.read_token_file(tmp_path / "t.bin")
    assert meta["num_tokens"] == 50 and tokens.tolist() == ids


def test_a_pair_file_read_as_token_file_is_named_as_one(tmp_path):
    """A translation pair file given where a language model's token file goes: the sidecar says which it
    is and what makes the other (mutation: the hint in capitals, survived; only test_eval read it)."""
    from lm.data.pairs import write_pair_file
    from lm.data.token_file import read_token_meta

    path = tmp_path / "val.bin"
    write_pair_file(path, [(np.array([5, 6]), np.array([7, 8]))], vocab_size=259)
    with pytest.raises(ValueError) as refused:
        read_token_meta(path)
    assert str(refused.value) == (
        f"sidecar {str(path) + '.json'!r} is not an 'lm-tokens' sidecar (it is a translation pair file, for an "
        "encoder-decoder model; make a language model's token file with `lm tokenize`)")


def test_bytes_per_token_is_the_sidecars_source_bytes_over_its_tokens(tmp_path):
    """The ratio that turns a loss per token into bits per byte: the source's bytes over the tokens, from
    the sidecar; None where it does not say or there is nothing to divide (mutation: the key read as None,
    reached by no test of this target: only the trainer's and lm eval's tests used it)."""
    from lm.data.token_file import bytes_per_token, read_token_meta

    write_token_file(tmp_path / "t.bin", np.arange(8), vocab_size=10, source_bytes=30)
    assert bytes_per_token(read_token_meta(tmp_path / "t.bin")) == 30 / 8
    for meta in ({"num_tokens": 8}, {"source_bytes": 0, "num_tokens": 8}, {"source_bytes": 30, "num_tokens": 0}):
        assert bytes_per_token(meta) is None, meta
