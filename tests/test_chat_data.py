"""``torchtsp prepare-data --format chat`` against transformers: for a ChatML (Qwen-style), a Llama-3-style, a
tool-calling and a ``{% generation %}``-marked template (each in a tokenizer folder built here), the stored tokens
of every conversation of examples/chat/conversations.jsonl equal transformers' ``apply_chat_template(messages,
tools=tools, tokenize=True)`` and the stored mask equals one computed here: transformers'
``return_assistant_tokens_mask`` for the marked template, else this file's own rendering of prefixes with
transformers and its tokenizer's offsets. By hand: the targets of a ChatML conversation are exactly the assistant's
text and its end marker. Bad input is one line naming the file and record, and nothing is left at PREFIX."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from torchtsp.cli import main  # noqa: E402
from torchtsp.data.chat import mask_prefix, open_chat_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "examples" / "chat" / "conversations.jsonl"

# A message's content, a string or a list of text parts, as real templates write it.
CONTENT = ("{% if m['content'] is string %}{{ m['content'] }}{% elif m['content'] %}"
           "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n" + CONTENT + "<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}"
          "{% for p in m['content'] %}{{ p['text'] | trim }}{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Hermes / Qwen2.5-style tools: the schemas in a system block, calls as <tool_call> JSON, results as <tool_response>.
TOOLS = ("{% if tools %}<|im_start|>system\nYou may call these tools:\n{% for t in tools %}{{ t | tojson }}\n"
         "{% endfor %}<|im_end|>\n{% endif %}"
         "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}"
         "\n</tool_response><|im_end|>\n"
         "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n"
         "{% for c in m['tool_calls'] %}<tool_call>\n{\"name\": {{ c['function']['name'] | tojson }}, \"arguments\": "
         "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
         "{% else %}<|im_start|>{{ m['role'] }}\n" + CONTENT + "<|im_end|>\n{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The marked text leaves out the end marker, which prefixes would take in: the markers, not prefixes, decide.
GENERATION = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
              "{% generation %}" + CONTENT + "{% endgeneration %}<|im_end|>\n{% else %}" + CONTENT +
              "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# No special tokens, and a generation prompt that ends in the space before the answer: the answer's first token
# (' Yes', the space and the word) straddles the boundary and is a target, as transformers' rule has it.
PLAIN = ("{% for m in messages %}{{ m['role'] }}: " + CONTENT + "\n{% endfor %}"
         "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def tokenizer_folder(folder: Path, template: str | None, special: list[str], **config) -> Path:
    """A byte-level BPE (a few hundred merges learnt from the sample) with ``special`` as special tokens, and a
    tokenizer_config.json holding ``template`` and ``config``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([SAMPLE.read_text()], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


FOLDERS = {
    "chatml": (CHATML, CHATML_TOKENS, {"eos_token": "<|im_end|>"}),
    "llama3": (LLAMA3, LLAMA3_TOKENS, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "tools": (TOOLS, CHATML_TOKENS, {"eos_token": "<|im_end|>"}),
    "generation": (GENERATION, CHATML_TOKENS, {"eos_token": "<|im_end|>"}),
    "plain": (PLAIN, [], {}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-tokenizers")
    return {name: tokenizer_folder(root / name, template, special, **config)
            for name, (template, special, config) in FOLDERS.items()}


def conversations(path: Path = SAMPLE) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prepare(tokenizer: Path, out: Path, *inputs: Path, expect: int = 0, extra=()) -> None:
    code = main(["prepare-data", "--format", "chat", "--tokenizer", str(tokenizer), "--out", str(out),
                 *map(str, inputs or [SAMPLE]), *extra])
    assert code == expect


def error_line(capsys) -> str:
    """The one error line of a refused run (the progress bar before it redraws itself with carriage returns)."""
    err = capsys.readouterr().err
    lines = [line for line in err.split("\n") if line.strip()]
    assert "Traceback" not in err and lines[-1].startswith("torchtsp: error: ") and err.count("torchtsp:") == 1, err
    return lines[-1]


def stored(out: Path) -> list[tuple[list[int], list[int]]]:
    tokens, mask = open_chat_dataset(out)
    return [(tokens.sequence(i).tolist(), mask.sequence(i).tolist()) for i in range(tokens.n_sequences)]


def hf_ids(hf, record) -> list[int]:
    out = hf.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def prefix_spans(hf, record) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering and the assistant's character spans in it, computed with transformers: assistant message
    k's text runs from the end of messages[:k] rendered with the generation prompt to the end of messages[:k+1]
    rendered without it."""
    messages, tools = record["messages"], record.get("tools")
    render = lambda ms, prompt: hf.apply_chat_template(ms, tools=tools, tokenize=False, add_generation_prompt=prompt)
    whole = render(messages, False)
    spans = [(len(render(messages[:k], True)), len(render(messages[:k + 1], False)))
             for k, m in enumerate(messages) if m["role"] == "assistant"]
    return whole, spans


def offsets(hf, text: str) -> list[tuple[int, int]]:
    return hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]


def prefix_mask(hf, record) -> list[int]:
    """A token is a target when one of its characters lies in an assistant span."""
    whole, spans = prefix_spans(hf, record)
    return [int(any(s < span_end and e > span_start for span_start, span_end in spans)) for s, e in offsets(hf, whole)]


@pytest.mark.parametrize("name", list(FOLDERS))
def test_tokens_and_mask_equal_transformers(folders, tmp_path, name, capsys):
    out = tmp_path / "chat"
    prepare(folders[name], out)
    hf = transformers.AutoTokenizer.from_pretrained(folders[name])
    records = conversations()
    got = stored(out)
    assert len(got) == len(records)
    for record, (ids, mask) in zip(records, got):
        assert ids == hf_ids(hf, record)
        if name == "generation":
            expected = hf.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True,
                                              return_dict=True, return_assistant_tokens_mask=True)["assistant_masks"]
        else:
            expected = prefix_mask(hf, record)
        assert mask == list(expected)
        assert 0 < sum(mask) < len(mask)
    if name == "plain":  # the case the rule is for: a token that starts in the prompt and ends in the answer
        whole, spans = prefix_spans(hf, records[0])
        assert any(s < start < e for s, e in offsets(hf, whole) for start, _ in spans)
    sidecar = json.loads(Path(str(out) + ".json").read_text())
    lengths = [len(ids) for ids, _ in got]
    assert sidecar["format"] == "chat" and sidecar["mask"] == "chat-mask"
    assert (sidecar["conversations"], sidecar["tokens"], sidecar["longest_conversation"]) == \
        (len(records), sum(lengths), max(lengths))
    assert sidecar["assistant_tokens"] == sum(sum(m) for _, m in got) and sidecar["skipped_no_assistant"] == 0
    summary = capsys.readouterr().out
    assert f"{len(records)} conversations" in summary and f"longest conversation {max(lengths)} tokens" in summary


def test_the_targets_are_the_assistant_text_and_its_end_marker(folders, tmp_path):
    """By hand, for ChatML: the header '<|im_start|>assistant\\n' and every user token are context; the answer,
    '<|im_end|>' and the newline the template writes after it (the end of messages[:k+1]) are targets."""
    hf = transformers.AutoTokenizer.from_pretrained(folders["chatml"])
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Name the largest planet."},
                                             {"role": "assistant", "content": "jupiter."},
                                             {"role": "user", "content": "And the smallest?"},
                                             {"role": "assistant", "content": "mercury."}]}) + "\n")
    prepare(folders["chatml"], tmp_path / "one", path)
    [(ids, mask)] = stored(tmp_path / "one")
    runs, previous = [], 0
    for i, m in enumerate(mask + [0]):
        if m and not previous:
            begin = i
        if previous and not m:
            runs.append(hf.decode(ids[begin:i]))
        previous = m
    assert runs == ["jupiter.<|im_end|>\n", "mercury.<|im_end|>\n"]


def test_parquet_lists_of_structs_and_json_strings_give_the_same_dataset(folders, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    records = [r for r in conversations() if "tools" not in r and all(isinstance(m["content"], str)
                                                                       for m in r["messages"])]
    lines = tmp_path / "c.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.table({"messages": [r["messages"] for r in records]}), tmp_path / "structs.parquet")
    pq.write_table(pa.table({"messages": [json.dumps(r["messages"]) for r in records]}), tmp_path / "json.parquet")
    for name in ("c.jsonl", "structs.parquet", "json.parquet"):
        prepare(folders["chatml"], tmp_path / name.replace(".", "_"), tmp_path / name)
    expected = stored(tmp_path / "c_jsonl")
    assert stored(tmp_path / "structs_parquet") == expected == stored(tmp_path / "json_parquet")


def test_a_conversation_without_an_assistant_message_is_skipped_and_counted(folders, tmp_path, capsys):
    path = tmp_path / "c.jsonl"
    path.write_text(SAMPLE.read_text() + json.dumps({"messages": [{"role": "user", "content": "hello?"}]}) + "\n")
    prepare(folders["chatml"], tmp_path / "c", path)
    sidecar = json.loads((tmp_path / "c.json").read_text())
    assert sidecar["skipped_no_assistant"] == 1 and sidecar["conversations"] == len(conversations())
    assert "1 without an assistant message skipped" in capsys.readouterr().out


BAD_RECORDS = [
    ({"text": "not a conversation"}, 'the record\'s "messages" is missing'),
    ({"messages": [{"role": "narrator", "content": "Once"}, {"role": "assistant", "content": "upon"}]},
     'message 1 has role "narrator"'),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "five"}]},
     "message 1 (user) has content of type int"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                   {"role": "assistant", "content": "a cat"}]}, "message 1 (user) has content of type list"),
]


@pytest.mark.parametrize("record, words", BAD_RECORDS)
def test_a_bad_record_is_one_line_naming_file_and_line_and_nothing_is_written(folders, tmp_path, capsys, record,
                                                                            words):
    path = tmp_path / "c.jsonl"
    first = SAMPLE.read_text().splitlines()[0]
    path.write_text(first + "\n" + json.dumps(record) + "\n")
    prepare(folders["chatml"], tmp_path / "out" / "c", path, expect=2)
    err = error_line(capsys)
    assert f"{path}:2:" in err and words in err, err
    assert not list((tmp_path / "out").glob("*"))


def _refused(folder: Path, tmp_path: Path, capsys) -> str:
    prepare(folder, tmp_path / "out" / "c", expect=2)
    assert not list((tmp_path / "out").glob("*"))
    return error_line(capsys)


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path, capsys):
    folder = tokenizer_folder(tmp_path / "plain", None, CHATML_TOKENS)
    assert "has no chat template" in _refused(folder, tmp_path, capsys)


def test_a_template_that_raises_names_the_record_and_its_message(tmp_path, capsys):
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system prompts here') }}{% endif %}" \
        + CHATML
    err = _refused(tokenizer_folder(tmp_path / "raises", template, CHATML_TOKENS), tmp_path, capsys)
    assert f"{SAMPLE}:1:" in err and "no system prompts here" in err, err


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path, capsys):
    """Only the last message keeps its text (as templates that drop earlier reasoning do): prefixes of the
    conversation are not prefixes of its rendering, so its assistant text cannot be found without markers."""
    template = CHATML.replace(CONTENT, "{% if loop.last %}" + CONTENT + "{% endif %}")
    err = _refused(tokenizer_folder(tmp_path / "rewrites", template, CHATML_TOKENS), tmp_path, capsys)
    assert f"{SAMPLE}:1:" in err and "{% generation %}" in err, err


def test_a_refused_run_leaves_an_existing_dataset_as_it_was(folders, tmp_path, capsys):
    out = tmp_path / "c"
    prepare(folders["chatml"], out)
    before = stored(out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    prepare(folders["chatml"], out, bad, expect=2, extra=["--overwrite"])
    assert stored(out) == before and sorted(p.name for p in tmp_path.glob("c*")) == \
        ["c-mask.bin", "c-mask.idx", "c.bin", "c.idx", "c.json"]


def test_a_text_dataset_is_not_a_chat_dataset(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("just text")
    assert main(["prepare-data", "--tokenizer", "byte", "--out", str(tmp_path / "t"), str(text)]) == 0
    with pytest.raises(FileNotFoundError, match="not a chat dataset"):
        open_chat_dataset(tmp_path / "t")
    assert mask_prefix(tmp_path / "t") == str(tmp_path / "t") + "-mask"


def test_without_jinja2_one_line_names_the_extra(folders, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "jinja2", None)  # import jinja2 now raises ImportError
    assert "pip install 'torchtsp[serve]'" in _refused(folders["chatml"], tmp_path, capsys)


def test_text_only_flags_are_refused_with_chat(folders, tmp_path, capsys):
    prepare(folders["chatml"], tmp_path / "out" / "c", expect=2, extra=["--no-eos"])
    assert "--no-eos is for --format text" in error_line(capsys)
    assert not (tmp_path / "out").exists()
