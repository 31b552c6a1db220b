"""Helpers shared by tests (importable by spawned ranks, which unpickle functions by module name)."""

import contextlib
import io
import os
import subprocess

import torch


def cli_in_process(*args) -> subprocess.CompletedProcess:
    """``python -m torchtsp ARGS`` as its ``main`` in this process, returned as the finished process would be (exit
    code, stdout, stderr), with ``TORCHTSP_DEBUG=0`` as the subprocess tests set it. For refusals and other paths
    that end before any rank starts: a fresh interpreter costs seconds of imports (torch) per call. The command
    line as a process stays tested where the process is the point (signals, exit on a dead rank, the entry point:
    tests/test_cli.py)."""
    from torchtsp.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved = os.environ.get("TORCHTSP_DEBUG")
    os.environ["TORCHTSP_DEBUG"] = "0"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        if saved is None:
            del os.environ["TORCHTSP_DEBUG"]
        else:
            os.environ["TORCHTSP_DEBUG"] = saved
    return subprocess.CompletedProcess(["torchtsp", *map(str, args)], code, out.getvalue(), err.getvalue())


def is_rank(pid: int) -> bool:
    """Whether process ``pid`` is a rank a torchtsp launcher started (read from /proc): ranks are forked from
    multiprocessing's fork server, so they and the server share its command line; a rank's parent is the server."""
    def cmdline(p):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                return f.read()
        except OSError:
            return b""

    def parent(p):
        try:
            with open(f"/proc/{p}/stat") as f:
                return int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return -1

    server = b"multiprocessing.forkserver"
    return server in cmdline(pid) and server in cmdline(parent(pid))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - b| / max |b|: error relative to the tensor's scale, robust to near-zero entries."""
    scale = expected.abs().max().item()
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0)


def batch(cfg, B, S, seed=0, ignore=3):
    """Random tokens and labels [B, S]; the first ``ignore`` labels of row 0 are ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    labels[0, :ignore] = -100
    return tokens, labels


def compare_with_reference(model, ref, loss, ref_loss) -> dict:
    """After backward on both: the losses, each reference parameter's full-gradient error, and whether
    ``full_grads()`` names exactly the reference parameters."""
    grads = model.full_grads()
    names = sorted(n for n, _ in ref.named_parameters())
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "names": sorted(grads) == names,
            "grad_err": {n: rel_err(grads[n], p.grad) for n, p in ref.named_parameters()}}


def run_against_reference(cfg, mesh, scheme, B, S, **options) -> dict:
    """Run ``scheme`` and the reference (same seed, same batch) forward + backward and compare them."""
    import copy

    import torchtsp

    torch.manual_seed(0)
    ref = torchtsp.Transformer(cfg)
    tokens, labels = batch(cfg, B, S)
    model = torchtsp.parallelize(copy.deepcopy(ref), mesh, scheme, **options)
    loss = model.loss(tokens, labels)
    loss.backward()
    ref_loss = ref.loss(tokens, labels)
    ref_loss.backward()
    return compare_with_reference(model, ref, loss, ref_loss)


def spread_hf_weights(model, router: str | None = None) -> None:
    """Re-draw a tiny Hugging Face model's weights so that every feature shows in its output: norms not ones
    (a swapped or missing norm, q/k norms included, must change the output), biases large next to x @ W (a bias
    on the wrong projection must show), and, with ``router`` (the router weight's name suffix), a router with
    opinions: clear top-k choices, far from ties."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias") or (router is not None and name.endswith(router)):
                p.normal_(std=0.5)
            else:
                p.normal_(std=0.1)


def hf_batch(vocab: int, batch: int, seq_len: int, seed: int = 1):
    """(tokens, labels) [batch, seq_len] with some ignored targets; the last position has no target, as in
    Hugging Face's own loss, which shifts the labels itself."""
    from torchtsp.layers import IGNORE_INDEX

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(vocab, (batch, seq_len + 1), generator=g)
    tokens, labels = seq[:, :-1], seq[:, 1:].clone()
    labels[0, :4] = IGNORE_INDEX
    labels[:, -1] = IGNORE_INDEX
    return tokens, labels


def tiny_hf_llama(folder, chat_template: str | None = None, seed: int = 0, max_position_embeddings: int = 128,
                  added_tokens: dict[str, bool] | None = None, eos_token: str = "</s>"):
    """A byte-level BPE tokenizer trained on a small corpus (``test_workflow.sentences``) and a random tiny
    Hugging Face Llama of its vocabulary, saved together in ``folder``; returns the EOS id. ``added_tokens``: more
    tokens (text -> whether it is special), e.g. a reasoning model's markers; ``eos_token``: one of them or
    ``</s>``."""
    import json

    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from test_workflow import sentences

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sentences(300, seed), trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    for text, special in (added_tokens or {}).items():
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": eos_token, "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    eos = tok.token_to_id(eos_token)
    torch.manual_seed(seed)
    hf_config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=max_position_embeddings,
                                         bos_token_id=tok.token_to_id("<s>"), eos_token_id=eos,
                                         tie_word_embeddings=False)
    transformers.LlamaForCausalLM(hf_config).save_pretrained(folder)
    return eos


def metric_samples(text: str, model_name: str) -> dict:
    """A /metrics text's samples, parsed by prometheus_client's own reader, keyed ``name{label="value",...}`` without
    the model_name label, which every sample must carry (the served model's name)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name", None) == model_name, sample
            shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[sample.name + (f"{{{shown}}}" if shown else "")] = sample.value
    return out
