"""The real workflow end to end, through the command line: a BPE tokenizer trained with ``tokenizers``, a random
Hugging Face Llama saved with it, ``prepare-data`` on a jsonl corpus, ``train --init-from-hf`` with evaluation,
``convert`` to Hugging Face, ``generate --hf`` with a text prompt; transformers loads the export and its
tokenizer and produces the same greedy text."""

import json

import pytest
import torch

from helpers import cli_in_process

WORDS = "the cat dog bird sat ran flew on in over a mat park tree and then".split()


def cli(*args):
    """The command line's ``main`` in this process (ranks and prepare-data's workers are real processes); a fresh
    interpreter per command would add seconds of imports each. The entry point as a process: tests/test_cli.py."""
    result = cli_in_process(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def sentences(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (int(torch.randint(20, 40, (1,), generator=g)),),
                                                     generator=g)) for _ in range(n)]


def test_tokenizer_to_generation(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # 1. A byte-level BPE tokenizer trained on the corpus, saved as a Hugging Face tokenizer folder.
    train_texts, eval_texts = sentences(400, 0), sentences(60, 1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(train_texts, trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = tmp_path / "hf_start"
    hf.mkdir()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                          "tokenizer_class": "PreTrainedTokenizerFast"}))
    eos = tok.token_to_id("</s>")

    # 2. A random tiny Llama with that vocabulary, saved by transformers.
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, bos_token_id=tok.token_to_id("<s>"),
                                      eos_token_id=eos, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(hf)

    # 3. prepare-data: jsonl corpora into Megatron datasets.
    for name, texts in (("train", train_texts), ("eval", eval_texts)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        cli("prepare-data", tmp_path / f"{name}.jsonl", "--tokenizer", hf, "--out", tmp_path / name, "--workers", 2)
    sidecar = json.loads((tmp_path / "train.json").read_text())
    assert sidecar["documents"] == 400 and sidecar["dtype"] == "uint16" and sidecar["tokenizer"]["eos_id"] == eos

    # 4. Train from the checkpoint, with evaluation.
    run = tmp_path / "run"
    cli("train", "--init-from-hf", hf, "--data", tmp_path / "train", "--eval-data", tmp_path / "eval",
        "--eval-every", 10, "--steps", 20, "--nproc", 2, "--tsp", 2, "--batch-size", 8, "--seq-len", 32, "--lr", 1e-2,
        "--sample-tokens", 0, "--out", run)
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]  # it learns the corpus, in the model's own tokens

    # 5. Export to Hugging Face (the run kept its tokenizer) and generate from a text prompt.
    cli("convert", run, tmp_path / "hf_out")
    assert (tmp_path / "hf_out" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    out = json.loads(cli("generate", "--hf", tmp_path / "hf_out", "--prompt", "the", "--max-new-tokens", 8,
                         "--json").stdout.strip().splitlines()[-1])

    override = json.loads(cli("generate", "--hf", tmp_path / "hf_out", "--tokenizer", hf, "--prompt", "the",
                              "--max-new-tokens", 8, "--json").stdout.strip().splitlines()[-1])
    assert override["tokens"] == out["tokens"]  # --tokenizer DIR: the same tokenizer, named explicitly

    # 6. transformers loads the export and its tokenizer and gives the same greedy text.
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf_out")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").float().eval()
    prompt = tokenizer("the", add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    assert out["tokens"][0] == ids[0].tolist()
    assert len(ids[0]) > prompt.shape[1] + 1  # a continuation, not just the end of the document
    assert out["text"][0] == tokenizer.decode(ids[0], skip_special_tokens=True)
