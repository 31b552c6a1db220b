"""Tokenizers: the byte tokenizer of presets trained from scratch, and a model's own Hugging Face tokenizer.

A Hugging Face tokenizer is its folder's ``tokenizer.json`` (read with the ``tokenizers`` library) plus,
when present, ``tokenizer_config.json`` for the BOS and EOS tokens and the chat template. Its fingerprint
is the sha256 of ``tokenizer.json``: a prepared dataset records it, and the trainer refuses a dataset
prepared with another tokenizer than the model's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..paths import hub_blobs

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Where transformers 5's save_pretrained writes the chat template (rather than into tokenizer_config.json).
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The named special tokens transformers passes to a chat template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
BYTE_FINGERPRINT = "byte"  # the byte tokenizer has no file: its name stands for its fingerprint


@dataclass(frozen=True)
class VocabEncoding:
    """How a tokenizer's vocabulary spells text, which a constrained decoder (xgrammar) needs to read each token as
    the bytes it stands for. ``kind``: "byte_level" (GPT-2's byte-to-character map: GPT-2, Llama 3, Qwen),
    "byte_fallback" (SentencePiece pieces, ``▁`` for a space and ``<0xNN>`` for a byte outside the pieces:
    Llama 2, Mistral) or "raw" (a token is its text); ``add_prefix_space``: the tokenizer prepends ``▁`` to the
    text it encodes (a SentencePiece-style Llama 2)."""

    kind: str
    add_prefix_space: bool


def _components(section, many: str) -> list[dict]:
    """A tokenizer.json section (decoder, normalizer) as its list of components: a ``Sequence`` lists them under
    ``many``; any other type is one. Whatever is not an object with a type is skipped."""
    if not isinstance(section, dict):
        return []
    parts = section.get(many) if section.get("type") == "Sequence" else [section]
    return [p for p in parts if isinstance(p, dict) and isinstance(p.get("type"), str)] if isinstance(parts, list) \
        else []


def read_vocab_encoding(spec: dict) -> VocabEncoding:
    """A tokenizer.json's (the ``tokenizers`` library's serialization, as a dict) VocabEncoding, read as xgrammar
    reads it from the same file: the first ByteLevel or ByteFallback component of the ``decoder`` names the kind
    (neither: raw, as with no decoder at all); a space is prepended when the ``normalizer`` has a ``Prepend`` of
    ``▁`` or the ``pre_tokenizer`` is a ``Metaspace`` whose ``prepend_scheme`` is "always" or "first"."""
    decoders = [d["type"] for d in _components(spec.get("decoder"), "decoders")]
    kind = next((t for t in decoders if t in ("ByteLevel", "ByteFallback")), None)
    prepend = any(n["type"] == "Prepend" and n.get("prepend") == "\u2581"
                  for n in _components(spec.get("normalizer"), "normalizers"))
    pre = spec.get("pre_tokenizer")
    metaspace = isinstance(pre, dict) and pre.get("type") == "Metaspace" and \
        pre.get("prepend_scheme") in ("always", "first")
    return VocabEncoding({"ByteLevel": "byte_level", "ByteFallback": "byte_fallback"}.get(kind, "raw"),
                         prepend or metaspace)


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; id 256 marks the end of a document."""

    vocab_size = 257
    eot_id = 256
    eos_id = 256
    bos_id = None
    chat_template = None
    fingerprint = BYTE_FINGERPRINT
    name = "the byte tokenizer"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(i for i in map(int, ids) if 0 <= i < 256).decode("utf-8", errors="replace")


BYTE_EOS_TOKEN = "<|endoftext|>"  # the byte tokenizer's id 256 in its Hugging Face files


def _byte_characters() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters, which ``tokenizers``' ByteLevel pre-tokenizer and
    decoder use: the printable Latin-1 bytes are themselves, the others 256 + their rank."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def write_byte_tokenizer(folder: str | Path) -> list[str]:
    """The byte tokenizer as Hugging Face files in ``folder``, so that a model trained on bytes is served and
    loaded like any other: ``tokenizer.json`` (byte b is id b: a BPE without merges over the ByteLevel
    characters; ``<|endoftext|>``, a special token, is id 256, the EOS) and ``tokenizer_config.json``. Text that
    spells ``<|endoftext|>`` itself is the one difference: these files read it as id 256, ByteTokenizer as bytes.
    Returns the names written."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    vocab = {char: b for b, char in _byte_characters().items()}
    tokenizer = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BYTE_EOS_TOKEN, special=True, normalized=False)])
    assert tokenizer.token_to_id(BYTE_EOS_TOKEN) == ByteTokenizer.eos_id  # the next id after the 256 bytes
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        (folder / name).unlink(missing_ok=True)  # a link already there must not be written through
    tokenizer.save(str(folder / TOKENIZER_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": BYTE_EOS_TOKEN,
              "clean_up_tokenization_spaces": False, "model_max_length": 1_000_000_000}
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]


def file_fingerprint(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_file(folder: str | Path, name: str) -> Path | None:
    """``folder / name`` when it is a file, None when absent. A link that leads outside ``folder`` is refused,
    for reading as for copying: a crafted folder must not make torchtsp read or export a file elsewhere (a
    Hugging Face hub snapshot's links into its own cache's ``blobs`` are the one exception, as for weights)."""
    path = Path(folder) / name
    if not path.is_file():
        return None
    target, roots = path.resolve(), [Path(folder).resolve(), hub_blobs(folder)]
    if not any(root is not None and target.is_relative_to(root) for root in roots):
        raise ValueError(f"{path} is a link to {target}, outside {folder}; torchtsp reads and copies a tokenizer's "
                         f"files only from inside its folder: put the file itself there in place of the link")
    return path


def _read_config(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); restore it from the model's checkpoint") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config


class HFTokenizer:
    """A Hugging Face tokenizer folder (``tokenizer.json`` + optional ``tokenizer_config.json``)."""

    def __init__(self, folder: str | Path, eos_id: int | None = None):
        """``eos_id``: the model's own EOS (config.json), used when tokenizer_config.json names none."""
        if not str(folder).strip():  # Path("") is the current folder: an unset variable must not pick it
            raise ValueError("the tokenizer is an empty path; give the folder holding the model's tokenizer.json")
        folder = Path(folder)
        path = folder / TOKENIZER_FILE if folder.is_dir() else folder
        folder = path.parent
        if tokenizer_file(folder, path.name) is None:
            raise FileNotFoundError(f"{path} does not exist; give a folder holding the model's {TOKENIZER_FILE}")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise OSError("reading tokenizer.json needs the tokenizers library: pip install tokenizers") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception for a malformed file
            cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(f"{path} is not a valid tokenizer file, it looks truncated or malformed ({cause}); "
                             f"restore it from the model's checkpoint") from None
        self.path, self.folder = path, folder
        self.fingerprint = file_fingerprint(path)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        # Every file a copy of this tokenizer would take is checked now, so a crafted folder is refused when it
        # is named (before any rank starts), not when a run or convert copies it.
        files = tokenizer_files(folder)
        self.config_path = files.get(TOKENIZER_CONFIG_FILE, folder / TOKENIZER_CONFIG_FILE)
        self.template_path = files.get(CHAT_TEMPLATE_FILE)
        config = _read_config(files.get(TOKENIZER_CONFIG_FILE))
        self.chat_template = config.get("chat_template")  # as the file holds it: read_chat_template resolves it
        # The named special tokens as text, which transformers hands every chat template (its special_tokens_map).
        self.special_tokens = {key: text for key in SPECIAL_TOKEN_KEYS
                               if (text := _token_text(config.get(key))) is not None}
        self.bos_id = self._token_id(config.get("bos_token"))
        self.pad_id = self._token_id(config.get("pad_token"))
        named_eos = self._token_id(config.get("eos_token"))
        self.eos_id = named_eos if named_eos is not None else eos_id
        self.name = str(path)

    def vocab_encoding(self) -> VocabEncoding:
        """How this tokenizer's vocabulary spells text (``read_vocab_encoding`` of its tokenizer.json)."""
        return read_vocab_encoding(json.loads(self.tokenizer.to_str()))

    def _token_id(self, value) -> int | None:
        text = _token_text(value)
        return None if text is None else self.tokenizer.token_to_id(text)

    @property
    def eot_id(self) -> int | None:
        return self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` and each one's (start, end) character span in it."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(map(int, ids)))


Tokenizer = ByteTokenizer | HFTokenizer


def read_chat_template(tokenizer: Tokenizer) -> str | None:
    """The tokenizer's own chat template, as transformers picks it: its folder's chat_template.jinja, else
    tokenizer_config.json's ``chat_template`` (a string, or a list of {"name", "template"} of which the one named
    "default"); None when it has none. A malformed one is a one-line error naming the file."""
    path = getattr(tokenizer, "template_path", None)
    if path is not None:
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); fix the file") from None
    source = getattr(tokenizer, "chat_template", None)
    where = getattr(tokenizer, "config_path", TOKENIZER_CONFIG_FILE)
    if isinstance(source, list):
        for i, entry in enumerate(source):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError(f"{where}: chat_template is a list whose item {i} is not an object with string "
                                 f"'name' and 'template' ({type(entry).__name__}); fix the file")
        source = next((t["template"] for t in source if t["name"] == "default"), None)
    if source is not None and not isinstance(source, str):
        raise ValueError(f"{where}: chat_template must be a string or a list of named templates, not "
                         f"{type(source).__name__}; fix the file")
    return source


def load_tokenizer(spec: str | Path, eos_id: int | None = None) -> Tokenizer:
    """``"byte"``: the byte tokenizer; else a folder holding tokenizer.json (or the file itself)."""
    if str(spec) == "byte":
        return ByteTokenizer()
    if not str(spec).strip():
        raise ValueError("--tokenizer is an empty path; give the folder holding the model's tokenizer.json, or "
                         "'byte' (an unset variable?)")
    return HFTokenizer(spec, eos_id=eos_id)


def model_eos_id(folder: str | Path) -> int | None:
    """The EOS id a Hugging Face checkpoint's config.json names (its first, when it lists several)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    eos = _read_config(path).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return eos if isinstance(eos, int) else None


def hf_folder_tokenizer(folder: str | Path) -> HFTokenizer | None:
    """A Hugging Face checkpoint folder's own tokenizer, or None when it holds no tokenizer.json."""
    folder = Path(folder)
    if not (folder / TOKENIZER_FILE).is_file():
        return None
    return HFTokenizer(folder, eos_id=model_eos_id(folder))


TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json", CHAT_TEMPLATE_FILE)
RUN_TOKENIZER_DIR = "tokenizer"  # a training run keeps a copy of its model's tokenizer here


def tokenizer_files(src: str | Path) -> dict[str, Path]:
    """A tokenizer folder's files (those present) by name, every one checked by ``tokenizer_file``."""
    files = {name: tokenizer_file(src, name) for name in TOKENIZER_FILES}
    return {name: path for name, path in files.items() if path is not None}


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy a tokenizer's files (those present) from folder ``src`` into folder ``dst``; returns their names.
    Every file is checked before any is copied, and the copies are plain files (never links)."""
    import shutil

    files, dst = tokenizer_files(src), Path(dst)
    for name, path in files.items():
        dst.mkdir(parents=True, exist_ok=True)
        (dst / name).unlink(missing_ok=True)  # a link already at dst must not be written through
        shutil.copyfile(path, dst / name)
    return list(files)


def run_tokenizer_folder(checkpoint: str | Path) -> Path | None:
    """The tokenizer a training run kept (``RUN/tokenizer``), given the run folder or one of its checkpoints.
    The run wrote it as plain files, so a link out of the run folder is refused (a crafted run)."""
    p = Path(checkpoint)
    for run in (p, p.parent.parent if p.parent.name == "checkpoints" else None):
        kept = None if run is None else run / RUN_TOKENIZER_DIR
        if kept is not None and (kept / TOKENIZER_FILE).is_file():
            target = (kept / TOKENIZER_FILE).resolve()
            if not target.is_relative_to(run.resolve()):
                raise ValueError(f"{kept / TOKENIZER_FILE} leads to {target}, outside the run {run}; a run keeps "
                                 f"its tokenizer as plain files: the run is damaged or crafted")
            return kept
    return None
