"""`torchtsp train --data PREFIX` on a chat dataset: whole conversations packed into rows, the assistant tokens as
targets, and a loss that is the mean over every assistant target of the global batch, whatever the split.

Every loss is compared with something computed here without the trainer's data path: each conversation run
ALONE through the reference model (or transformers' model) from position 0, its assistant tokens' NLL summed, the
sums added and divided by the number of assistant tokens. Planted averaging bugs (a per-micro-batch mean, a
per-rank mean, a count that forgets a rank) must fail that comparison.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchtsp
from helpers import cli_in_process
from torchtsp.data.chat import mask_prefix, open_chat_dataset
from torchtsp.data.indexed import IndexedWriter
from torchtsp.data.tokenizers import BYTE_FINGERPRINT
from torchtsp.layers import IGNORE_INDEX
from torchtsp.train.checkpoint import load_full_state_dict
from torchtsp.train.config import TrainConfig
from torchtsp.train.data import TrainData
from torchtsp.train.trainer import run_training

S = 64  # --seq-len of the exactness runs
END_OF_TURN = 256  # the byte tokenizer's EOS, ending every turn as a chat template's <|im_end|> does
# float32 throughout. The same NLL terms are summed in other orders (per row, micro-batch and rank instead of per
# conversation) and attention runs over other block layouts (documents packed two to a row, zigzag chunks): the
# worst round-off relative to a loss of ~6 is ~1e-7 to 1e-6 (measured: 0 to 8e-8). Every averaging bug planted
# below moves the loss by 0.1% or more on these conversations (a per-micro-batch or per-rank mean: 0.12-0.5%, a count
# that forgets a rank: 80-130%), and is asserted to miss it by ten times the tolerance.
REL_TOL = 1e-5
MISSED = 10 * REL_TOL  # how far a planted bug's loss must be from the expected one


def write_chat_dataset(prefix: Path, conversations, dtype=np.uint16, sidecar: dict | None = None) -> str:
    """``conversations`` [(tokens, mask)] as a chat dataset: PREFIX.bin/.idx, PREFIX-mask.bin/.idx, PREFIX.json."""
    prefix = str(prefix)
    tokens = IndexedWriter(prefix, dtype)
    tokens.add_documents([np.asarray(t) for t, _ in conversations])
    tokens.finish()
    mask = IndexedWriter(mask_prefix(prefix), np.uint8)
    mask.add_documents([np.asarray(m, np.uint8) for _, m in conversations])
    mask.finish()
    record = {"format": "chat", "mask": Path(mask_prefix(prefix)).name, "documents": len(conversations),
              "tokens": int(sum(len(t) for t, _ in conversations)), "dtype": np.dtype(dtype).name,
              "max_id": int(max(max(t) for t, _ in conversations)), **(sidecar or {})}
    Path(prefix + ".json").write_text(json.dumps(record))
    return prefix


def uneven_conversations(weights: dict, n: int = 16, vocab: int = 256, seed: int = 0):
    """``n`` conversations of 22-32 tokens, so that any two share a row of S = 64 and no three fit: the rows of an
    epoch are n / 2 whatever the shuffle. Every other one is a long prompt with a one-token reply (1 target), the
    token the model with ``weights`` finds likeliest (a low NLL); the others alternate user and assistant turns of
    random tokens (about half of their tokens are targets, each of a high NLL). So a micro-batch's, a rank's or a
    row's mean depends on its mix, and any average over the wrong count shows. Every turn ends with END_OF_TURN:
    an EOS inside a conversation, never its end."""
    model = reference_model(weights)
    rng = np.random.default_rng(seed)
    conversations = []
    for i in range(n):
        length = int(rng.integers(22, 33))
        if i % 2 == 0:  # a prompt, then a one-token reply
            tokens = [*rng.integers(0, vocab, length - 2).tolist(), END_OF_TURN]
            with torch.no_grad():
                tokens.append(int(model(torch.tensor([tokens]))[0, -1, :vocab].argmax()))
            mask = [0] * (length - 1) + [1]
        else:
            tokens, mask, assistant = [], [], False
            while len(tokens) < length:
                turn = rng.integers(0, vocab, int(rng.integers(2, 6))).tolist() + [END_OF_TURN]
                tokens += turn
                mask += [int(assistant)] * len(turn)
                assistant = not assistant
            tokens, mask = tokens[:length], mask[:length]
            mask[0] = 0  # nothing predicts the first token
        conversations.append((tokens, mask))
    return conversations


def reference_nll(logits_of, conversations) -> tuple[torch.Tensor, int]:
    """(summed NLL of every assistant token, their count): each conversation alone, from position 0, through
    ``logits_of`` (a [1, L] batch -> [1, L, V] logits); token t is predicted by the logits at t - 1."""
    total, count = 0, 0
    for tokens, mask in conversations:
        x = torch.tensor([tokens])
        targets = torch.tensor(mask[1:], dtype=torch.bool)
        logits = logits_of(x)[0, :-1][targets]
        total = total + F.cross_entropy(logits.float(), x[0, 1:][targets], reduction="sum")
        count += int(targets.sum())
    return total, count


def spread_weights() -> dict[str, torch.Tensor]:
    """The tiny preset with weights drawn wide (std 0.1 instead of ~0.02), so that the NLL of one token differs
    from another's by several nats: at the usual initial values every token costs about ln(257) and the mean of
    any subset equals the mean of all, which no averaging bug could change."""
    torch.manual_seed(0)
    model = torchtsp.Transformer(torchtsp.get_preset("tiny"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(std=0.1)
    return model.state_dict()


def reference_model(weights: dict) -> torchtsp.Transformer:
    model = torchtsp.Transformer(torchtsp.get_preset("tiny"))
    model.load_state_dict(weights)
    return model


def reference_mean(conversations, weights) -> float:
    model = reference_model(weights)
    with torch.no_grad():
        total, count = reference_nll(model, conversations)
    return total.item() / count


@dataclass
class ChatData:
    prefix: str  # the chat dataset
    conversations: list
    weights: dict  # the initial weights, also saved as the Hugging Face folder ``hf``
    hf: str


def settings(chat: ChatData, out, **extra) -> dict:
    """A one-step run on the whole epoch (8 rows of 16 conversations) from ``chat``'s weights; no weight decay."""
    return {"data": chat.prefix, "init_from_hf": chat.hf, "seq_len": S, "batch_size": 8, "steps": 1,
            "sample_tokens": 0, "out": str(out), "lr": 1e-3, "weight_decay": 0.0, **extra}


def train_in_process(*flags):
    """``torchtsp train`` on one rank in this process (the command line trains a world of 1 in the launcher)."""
    result = cli_in_process("train", "--nproc", 1, *flags)
    assert result.returncode == 0, result.stderr
    return result


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").open()]


def flags(setting: dict) -> list:
    """``setting`` as ``--config TOML`` (some settings have no flag) beside the run folder."""
    out = Path(setting["out"])
    toml = out.with_name(out.name + ".toml")
    toml.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in setting.items()))
    return ["--config", toml]


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """The dataset of ``uneven_conversations`` and wide initial weights (``spread_weights``)."""
    from torchtsp.hf import save_hf_checkpoint

    folder = tmp_path_factory.mktemp("chat")
    weights = spread_weights()
    conversations = uneven_conversations(weights)
    prefix = write_chat_dataset(folder / "uneven", conversations,
                                sidecar={"tokenizer": {"fingerprint": BYTE_FINGERPRINT, "vocab_size": 257}})
    save_hf_checkpoint(folder / "hf", weights, torchtsp.get_preset("tiny"))
    return ChatData(prefix, conversations, weights, str(folder / "hf"))


# --------------------------------------------------------------------------- the stored format


def test_open_chat_dataset_reads_tokens_and_mask_and_refuses_a_foreign_mask(tmp_path, uneven):
    prefix, conversations = uneven.prefix, uneven.conversations
    tokens, mask = open_chat_dataset(prefix)
    assert mask_prefix(prefix) == prefix + "-mask"
    assert [tokens.sequence(i).tolist() for i in range(len(conversations))] == [t for t, _ in conversations]
    assert [mask.sequence(i).tolist() for i in range(len(conversations))] == [m for _, m in conversations]
    other = write_chat_dataset(tmp_path / "other", [(t[:-1], m[:-1]) for t, m in conversations])
    for suffix in (".bin", ".idx"):  # a mask whose conversations are one token longer
        Path(mask_prefix(other) + suffix).write_bytes(Path(mask_prefix(prefix) + suffix).read_bytes())
    with pytest.raises(ValueError, match="conversation 0 has 32 mask values but 31 tokens|mask belongs"):
        open_chat_dataset(other)


# --------------------------------------------------------------------------- packing


def rows_of_epoch(prefix, seq_len: int, **extra):
    """Every row the trainer's data path draws in the first epoch: (tokens, labels, documents) each [rows, S]."""
    cfg = TrainConfig(data=str(prefix), seq_len=seq_len, batch_size=1, out="/tmp/unused-run", **extra)
    data = TrainData(cfg, 257)
    rows = []
    while data.train.epoch < 1:
        rows.append(data.next_train_batch("cpu"))
    tokens, labels, ids = (torch.cat(part) for part in zip(*rows))
    return tokens, labels, ids, data


def documents_of(tokens, labels, ids):
    """Each row's documents as (tokens, labels) lists, and each row's padding."""
    found = []
    for row in range(tokens.shape[0]):
        for doc in ids[row].unique_consecutive().tolist():
            where = ids[row] == doc
            found.append((tokens[row][where].tolist(), labels[row][where].tolist()))
    return found


def expected_labels(tokens, mask):
    return [tokens[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(tokens) - 1)] + [IGNORE_INDEX]


def test_whole_conversations_per_row_positions_restart_and_targets_equal_the_mask(uneven):
    prefix, conversations = uneven.prefix, uneven.conversations
    tokens, labels, ids, data = rows_of_epoch(prefix, S)
    assert data.document_mask and data.notices == []  # on by default for chat data; nothing split
    assert tokens.shape == (len(conversations) // 2, S)  # two conversations per row, whatever the order
    docs = documents_of(tokens, labels, ids)
    whole = [(t, expected_labels(t, m)) for t, m in conversations]
    # Each conversation exactly once, whole, from its first token, with the mask's targets; the rest is padding
    # (ignored labels), one document per row's tail.
    found = [d for d in docs if d in whole]
    assert sorted(map(str, found)) == sorted(map(str, whole))
    padding = [d for d in docs if d not in whole]
    assert all(set(lab) == {IGNORE_INDEX} for _, lab in padding) and len(padding) <= tokens.shape[0]
    # Positions restart at 0 at every conversation: what the model's attention takes from the ids.
    positions = torchtsp.masks.Documents.from_ids(ids).positions
    for row in range(tokens.shape[0]):
        for doc in ids[row].unique_consecutive().tolist():
            assert positions[row][ids[row] == doc].tolist() == list(range(int((ids[row] == doc).sum())))
    # An END_OF_TURN inside a conversation ends no document.
    assert (tokens == END_OF_TURN).sum() > len(conversations)


def test_longer_conversations_are_split_into_row_sized_pieces_or_skipped(tmp_path):
    rng = np.random.default_rng(1)
    lengths = [5, 40, 7, 100, 12, 3]
    conversations = [(rng.integers(0, 256, n).tolist(), [0] + (rng.random(n - 1) < 0.5).astype(int).tolist())
                     for n in lengths]
    prefix = write_chat_dataset(tmp_path / "long", conversations)
    tokens, labels, ids, data = rows_of_epoch(prefix, 16)
    assert data.notices == [f"{prefix}: 2 of 6 conversations are longer than --seq-len 16 and were split"]
    docs = documents_of(tokens, labels, ids)
    for conv_tokens, mask in conversations:
        want = expected_labels(conv_tokens, mask)
        pieces = [(conv_tokens[s:s + 16], want[s:s + 16]) for s in range(0, len(conv_tokens), 16)]
        # Every piece a document of its own; a piece's last label still predicts the next piece's first token.
        assert all(piece in docs for piece in pieces), len(conv_tokens)
    no_piece_straddles = [d for d in docs if len(d[0]) > 16]
    assert not no_piece_straddles
    _, _, ids, data = rows_of_epoch(prefix, 16, max_conversation_tokens=40)
    assert data.notices == [f"{prefix}: 1 of 5 conversations are longer than --seq-len 16 and were split",
                            f"{prefix}: 1 of 6 conversations are longer than --max-conversation-tokens 40 and were "
                            f"skipped"]


# --------------------------------------------------------------------------- one rank, in this process


def accumulate_per_micro_batch_mean(model, tokens, labels, grad_accum, document_ids=None):
    """PLANTED BUG: accumulate.forward_backward with each micro-batch averaged over its own targets, and the
    micro-batch means averaged."""
    from torchtsp.train import accumulate

    total = torch.zeros(())
    for batch in accumulate._micro(tokens, labels, document_ids, grad_accum):
        terms = accumulate._loss_terms(model, *batch)
        loss = terms.nll_sum / terms.count / grad_accum
        loss.backward()
        total += loss.detach()
    return total


def test_one_rank_grad_accum_loss_is_the_mean_over_every_assistant_token(tmp_path, uneven, monkeypatch):
    conversations, weights = uneven.conversations, uneven.weights
    expected = reference_mean(conversations, weights)
    train_in_process(*flags(settings(uneven, tmp_path / "run", grad_accum=2)))
    got = losses(tmp_path / "run")[0]
    assert abs(got - expected) <= REL_TOL * expected, (got, expected)
    monkeypatch.setattr("torchtsp.train.trainer.forward_backward", accumulate_per_micro_batch_mean)
    train_in_process(*flags(settings(uneven, tmp_path / "bug", grad_accum=2)))
    wrong = losses(tmp_path / "bug")[0]
    assert abs(wrong - expected) > MISSED * expected, (wrong, expected)


def test_eval_reports_the_mean_over_assistant_tokens_and_resume_is_exact(tmp_path, uneven):
    conversations, weights = uneven.conversations, uneven.weights
    base = settings(uneven, tmp_path / "full", steps=4, checkpoint_every=2, eval_data=uneven.prefix, eval_every=2,
                    batch_size=4)
    train_in_process(*flags(base))
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").open()]
    # The eval after step 4 with the weights of step 4, against each eval conversation alone with those weights.
    _, weights = load_full_state_dict(tmp_path / "full")
    expected = reference_mean(conversations, weights)
    assert abs(records[-1]["eval_loss"] - expected) <= REL_TOL * expected, (records[-1]["eval_loss"], expected)
    # Resumed from step 2: the same rows (the data position is saved), so the same losses, bit for bit.
    train_in_process("--resume", tmp_path / "full" / "checkpoints" / "step_000002", "--out", tmp_path / "resumed")
    assert losses(tmp_path / "resumed") == [r["loss"] for r in records[2:]]


def test_refusals_are_one_line(tmp_path, uneven):
    prefix = uneven.prefix
    plain = tmp_path / "ids.npy"
    np.save(plain, np.arange(2000, dtype=np.int32) % 250)
    cases = [(["--data", f"0.5 {prefix} 0.5 {plain}"], "blends chat datasets with token streams"),
             (["--data", plain, "--max-conversation-tokens", 100], "applies to chat datasets"),
             (["--data", prefix, "--max-conversation-tokens", 10], "every one of its 16 conversations is longer")]
    for extra, message in cases:
        result = cli_in_process("train", "--seq-len", S, "--steps", 1, "--out", tmp_path / "refused", *extra)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    Path(mask_prefix(prefix) + ".bin").rename(tmp_path / "moved.bin")
    try:
        result = cli_in_process("train", "--data", prefix, "--steps", 1, "--out", tmp_path / "refused")
    finally:
        (tmp_path / "moved.bin").rename(mask_prefix(prefix) + ".bin")
    assert result.returncode == 2 and "mask" in result.stderr and "Traceback" not in result.stderr, result.stderr


# --------------------------------------------------------------------------- several ranks


@pytest.mark.parametrize("world,degrees", [(2, {"scheme": "tsp", "tsp": 2}), (4, {"scheme": "tp_sp", "tp": 2, "sp": 2}),
                                           (2, {"scheme": "dp", "dp": 2})])
def test_step_loss_and_weights_equal_one_device_on_uneven_conversations(pools, tmp_path, uneven, world, degrees):
    conversations, weights = uneven.conversations, uneven.weights
    cfg = TrainConfig(**settings(uneven, tmp_path / "run", grad_accum=2, **degrees))
    got = pools(world).run(run_training, cfg)[0]["losses"][0]
    # One device, one AdamW step on the loss computed here: the same lr (step 1 of 1 is the whole warmup), betas,
    # no weight decay, the gradient clipped to the same global norm.
    model = reference_model(weights)
    total, count = reference_nll(model, conversations)
    expected = total / count
    expected.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0).step()
    assert abs(got - expected.item()) <= REL_TOL * expected.item(), (got, expected.item())
    _, weights = load_full_state_dict(tmp_path / "run")
    for name, p in model.named_parameters():
        # AdamW's first update is lr * g / (|g| + eps), a sign-like step of lr = 1e-3 wherever |g| >> eps. Where the
        # gradient is as small as the float32 round-off of its sum (~1e-7 of the largest), round-off may flip its
        # sign: only elements above 1e-4 of the tensor's largest gradient are compared (elsewhere every weight
        # still moves at most lr). A wrong average scales every gradient alike and moves nothing Adam normalises,
        # so it is the loss above that catches it; this catches gradients of the wrong targets or documents.
        clear = grads[name].abs() > 1e-4 * grads[name].abs().max()
        diff = (weights[name] - p.detach())[clear].abs().max().item() if clear.any() else 0.0
        assert diff <= 1e-6, (name, diff)


def losses_with_planted_bugs(chat: ChatData, scheme: str):
    """On each of 2 ranks: the global-batch loss of the first chat batch, correct and with each planted averaging
    bug of ``scheme``'s reduction over ranks."""
    import torchtsp.parallel.dp as dp_module
    import torchtsp.parallel.tsp.model as tsp_module
    from torchtsp.layers import LossTerms
    from torchtsp.parallel.base import SumOverAxis

    mesh = torchtsp.init_mesh(**{scheme: 2})
    model = torchtsp.parallelize(reference_model(chat.weights), mesh, scheme)
    data = TrainData(TrainConfig(**settings(chat, "/tmp/unused-run")), 257, check=False)
    tokens, labels, ids = data.next_train_batch("cpu")
    results = {"real": model.loss(tokens, labels, ids).item()}
    if scheme == "dp":
        real = dp_module.DataParallel.loss_terms

        def per_rank_mean(self, tokens, labels, documents=None):
            nll_sum, count, router = self.module.loss_terms(tokens, labels, documents)
            mean = SumOverAxis.apply(nll_sum / count, self.dp) / 2  # each replica's mean, averaged
            return LossTerms(mean, torch.ones(()), router)

        def count_forgets_a_rank(self, tokens, labels, documents=None):
            nll_sum, count, router = self.module.loss_terms(tokens, labels, documents)
            return LossTerms(SumOverAxis.apply(nll_sum, self.dp), count, router)  # this replica's count only

        for name, bug in (("per-rank mean", per_rank_mean), ("count forgets a rank", count_forgets_a_rank)):
            dp_module.DataParallel.loss_terms = bug
            try:
                results[name] = model.loss(tokens, labels, ids).item()
            finally:
                dp_module.DataParallel.loss_terms = real
    else:
        real = tsp_module.global_sum_and_count

        def per_rank_mean(nll_sum, labels, comm):
            count = (labels != IGNORE_INDEX).sum().to(nll_sum.dtype)
            return SumOverAxis.apply(nll_sum / count, comm) / 2, torch.ones(())  # each rank's mean, averaged

        def count_forgets_a_rank(nll_sum, labels, comm):
            return SumOverAxis.apply(nll_sum, comm), (labels != IGNORE_INDEX).sum().to(nll_sum.dtype)

        for name, bug in (("per-rank mean", per_rank_mean), ("count forgets a rank", count_forgets_a_rank)):
            tsp_module.global_sum_and_count = bug
            try:
                results[name] = model.loss(tokens, labels, ids).item()
            finally:
                tsp_module.global_sum_and_count = real
    return results


@pytest.mark.parametrize("scheme", ["dp", "tsp"])
def test_planted_rank_averaging_bugs_fail_the_comparison(pools, uneven, scheme):
    conversations, weights = uneven.conversations, uneven.weights
    # The first batch holds 8 rows of 16 conversations: the whole epoch, every conversation once.
    expected = reference_mean(conversations, weights)
    results = pools(2).run(losses_with_planted_bugs, uneven, scheme)
    for rank in results:
        assert abs(rank["real"] - expected) <= REL_TOL * expected, (rank, expected)
        bugs = {k: v for k, v in rank.items() if k != "real"}
        assert bugs and all(abs(v - expected) > MISSED * expected for v in bugs.values()), (bugs, expected)


os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the family tests below read only the folders they write


# --------------------------------------------------------------------------- fine-tuning every family


def word_tokenizer(folder: Path, words: int = 90) -> None:
    """A word-level tokenizer of ``words`` ids (within every tiny family's 101), END_OF_TURN-like ``<|im_end|>`` its
    EOS, with a ChatML chat template in chat_template.jinja (where transformers 5 saves it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|im_end|>": 1, **{f"w{i}": i for i in range(2, words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}")


def family_conversations(n: int = 8, words: int = 90, seed: int = 3):
    """``n`` conversations of 11-16 tokens: any two share a row of 32 and no three fit (n / 2 rows an epoch), turns
    ending with id 1 (<|im_end|>), uneven assistant shares."""
    rng = np.random.default_rng(seed)
    conversations = []
    for i in range(n):
        length = int(rng.integers(11, 17))
        tokens = rng.integers(2, words, length).tolist()
        mask = [0] * length
        if i % 2:
            mask[-1] = 1  # a one-token reply
        else:
            mask[length // 2:] = [1] * (length - length // 2)  # a long reply
        tokens[length // 2 - 1] = 1
        conversations.append((tokens, mask))
    return conversations


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen2_moe", "mixtral"])
def test_init_from_hf_of_every_family_fine_tunes_and_converts_back_with_its_chat_template(tmp_path, family):
    pytest.importorskip("transformers")
    import transformers

    import test_hf_export
    from torchtsp.data.tokenizers import hf_folder_tokenizer, read_chat_template

    hf = test_hf_export.MAKERS[family]().eval()
    if hasattr(hf.config, "router_aux_loss_coef"):
        # The load-balancing loss is over a forward's tokens (padding included), not a sum over conversations: the
        # comparison with each conversation alone is of the NLL (the aux loss has its own tests in test_moe.py).
        hf.config.router_aux_loss_coef = 0.0
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    word_tokenizer(folder)
    conversations = family_conversations()
    prefix = write_chat_dataset(tmp_path / "chat", conversations)
    out = tmp_path / "run"
    setting = {"data": prefix, "init_from_hf": str(folder), "seq_len": 32, "batch_size": 4, "steps": 1,
               "sample_tokens": 0, "out": str(out), "lr": 1e-3}
    train_in_process(*flags(setting))
    with torch.no_grad():
        total, count = reference_nll(lambda x: hf(input_ids=x).logits, conversations)
    expected, got = total.item() / count, losses(out)[0]
    assert abs(got - expected) <= REL_TOL * expected, (family, got, expected)
    # Back to Hugging Face with the run's tokenizer and its chat template: what serve --hf and transformers read.
    result = cli_in_process("convert", out, tmp_path / "export")
    assert result.returncode == 0, result.stderr
    export = tmp_path / "export"
    assert (export / "chat_template.jinja").read_text() == (folder / "chat_template.jinja").read_text()
    assert read_chat_template(hf_folder_tokenizer(export)) == (folder / "chat_template.jinja").read_text()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert type(loaded) is type(hf)
    text = transformers.AutoTokenizer.from_pretrained(export).apply_chat_template(
        [{"role": "user", "content": "w5 w6"}], tokenize=False, add_generation_prompt=True)
    assert text == "user w5 w6 <|im_end|> assistant "
