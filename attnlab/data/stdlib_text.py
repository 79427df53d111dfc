"""Real text with nothing downloaded: the Python standard library's own source, one character per token.

Every Python installation holds its standard library as ``.py`` files under
``sysconfig.get_paths()["stdlib"]``. Lesson 09 trains a small GPT on a fixed list of them:
long-lived, mostly pure-Python modules written in plain ASCII (code, comments and English
docstrings), so the model has something to learn at two levels: the syntax of Python and the
prose of its documentation.

The corpus, fixed and documented:

- ``TRAIN_FILES`` (the training split) and ``VALID_FILES`` (the validation split) are whole
  files: no text of a validation file is ever seen in training. The files are read in the listed
  order and joined with a header line ``# ==== <name> ====``, so the text is the same on every
  machine that has the same files.
- The vocabulary is fixed, not taken from the text: ``"\\n"`` and the 95 printable ASCII
  characters (``VOCAB``, 96 tokens). A tab becomes four spaces and any other character (a rare
  non-ASCII letter in a comment) becomes ``"?"``; ``Corpus.replaced`` counts them. A fixed
  vocabulary means a checkpoint's embedding rows mean the same characters everywhere.
- The files change a little between Python releases (a docstring edited, a function added).
  ``REFERENCE_SHA256`` holds each file's SHA-256 as read on the Python that made the shipped
  checkpoint (``REFERENCE_PYTHON``); ``Corpus.differs`` lists the files whose content is not
  that one here, so a lesson can say whether this machine sees exactly the training text.

Example::

    corpus = load_corpus()
    x, y = corpus.batch("train", batch_size=8, seq_len=64, generator=torch.Generator().manual_seed(0))
    corpus.decode(x[0])          # 64 characters of Python source
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["VOCAB", "TRAIN_FILES", "VALID_FILES", "REFERENCE_SHA256", "REFERENCE_PYTHON", "Corpus", "load_corpus",
           "encode", "decode", "stdlib_dir"]

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))   # 96 characters: newline and printable ASCII
_INDEX = {ch: i for i, ch in enumerate(VOCAB)}
_UNKNOWN = "?"

# whole files: the validation files are never seen in training
TRAIN_FILES = (
    "bisect.py", "colorsys.py", "fnmatch.py", "textwrap.py", "queue.py", "sched.py", "numbers.py", "graphlib.py",
    "glob.py", "cmd.py", "string.py", "pprint.py", "difflib.py", "random.py", "calendar.py", "heapq.py", "shlex.py",
    "gettext.py", "tempfile.py", "contextlib.py", "functools.py", "dataclasses.py", "configparser.py", "optparse.py",
    "ipaddress.py", "argparse.py",
)
VALID_FILES = ("tabnanny.py", "reprlib.py")

# SHA-256 of each file's bytes on REFERENCE_PYTHON (the Python the shipped checkpoint was trained on)
REFERENCE_PYTHON = "3.11.7"
REFERENCE_SHA256 = {
    "bisect.py": "e5b2ff166f48a06e70ae831d8c9b47283fcd0c254306eee12d3dae9c55e11526",
    "colorsys.py": "d9800f8e81d46e63ca6f2e7d6ac5f344d85afb92c3cf6d103b5f977f1ad66ac2",
    "fnmatch.py": "6683da36e47af523f3f41e18ad244d837783e19e98911cc0b7415dea81494ebc",
    "textwrap.py": "62867e40cdea6669b361f72af4d7daf0359f207c92cbeddfc7c7506397c1f31c",
    "queue.py": "f6c37fc37cd7440979f7d22d40ee818fa3b714c573610c08fa52911d541193f0",
    "sched.py": "edfb309483d7cb05e06ad86d1fdeb819629f71402dc6710a1bec36c7afcaac50",
    "numbers.py": "6d70991643a109e9c99e94d6ea2734a995fa8e89114a70ea09737413fa9ae292",
    "graphlib.py": "7bd338c5a475d1101064603d3baa5507446d3c5e73f741f6d6e77c6204c1eb65",
    "glob.py": "fa579f8a50a66313d34d339f10be0821c9b4fed6207e8ba8e29ed1c5e119f740",
    "cmd.py": "fb82a8c4e44e5b559c88d516d79051534cec69a463df97defe05ac8a261f0a0d",
    "string.py": "24aeae1f0526250f442022022bf98df9a823b1cb330543ee79e70e44907462e9",
    "pprint.py": "0b67dbc8af449d8ced3acd9df902e98c2dbc56c8f2a7a181c51cc72768db621f",
    "difflib.py": "0c6afc23568d55b3e9ac914f9c5361e3033e778aa5b58d3cc82835fc5c638679",
    "random.py": "b931a2d452db89ab9e1f79d59b66ce194dbd6748049cfe44699726da52b9c956",
    "calendar.py": "b3b140864fd122a575ffcc9342b824fbe4f8a38fdf3f4fcd964f26e52725358f",
    "heapq.py": "6d43277e5c76fc0f073cd388fcff852d14d068f6bb6d4886c340f8b75a1229a9",
    "shlex.py": "42ab6060f316e121e374e6621d8c1c98b8db323903c3df289a810c45a8ae46a7",
    "gettext.py": "a5c249a522b6b8e3aa6f1b12a8bcc09508b99ad612b58d2fc973db27ea3b7cc3",
    "tempfile.py": "c9169b0ef905999b5d347544cfaa73c4f295777ac07a948aec1e4fdf3ce98a3b",
    "contextlib.py": "d732c045bc7450997f97b2f79cfdb1546b68d2655e89ab3170f3b19b3930d83c",
    "functools.py": "6d80018a3fa9fed44c5b78f881987ee3ab3fb1238b077b4e6dcb4b76da7db73b",
    "dataclasses.py": "4b7e1c99ebea53b546317d218a0261895a1769f83a6b95dc0136f13578066a7f",
    "configparser.py": "4a70cecccb55031a413b79e6ced2e63ca031f770cd25a4882980ecdeab67f6ff",
    "optparse.py": "07d224301cba312fa0697bff9cd5a4bb4f778a90629632091b3f4ae874d89af5",
    "ipaddress.py": "b157f2f318650698ac4cb81f41ece82a7a860f264c24cfc8dcc538977709ced3",
    "argparse.py": "dc1eba8adfdf615986421f981337458ba1072d3e718a0f76e3224940fd74118b",
    "tabnanny.py": "73bc1829f10634726db7a22f1cb5c06f76802d54cd7edba0ecff145156caa2f8",
    "reprlib.py": "264433cc232332db871666b3bb6e4c2cb97b092cb8d5056a45ec2e53daea2b1c",
}


def stdlib_dir() -> Path:
    """The folder of this Python's standard library (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _clean(text: str) -> tuple[str, int]:
    """Map ``text`` onto ``VOCAB``: tabs -> four spaces, ``\\r\\n`` -> ``\\n``, anything else -> ``"?"``."""
    text = text.replace("\r\n", "\n").replace("\t", "    ")
    replaced = sum(1 for ch in text if ch not in _INDEX)
    if replaced:
        text = "".join(ch if ch in _INDEX else _UNKNOWN for ch in text)
    return text, replaced


def encode(text: str) -> torch.Tensor:
    """Characters -> token ids (N,) long. Every character must be in ``VOCAB``.

    Example: ``encode("def f():")`` -> ``tensor([69, 70, 71, 1, 71, 9, 10, 27])``
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    bad = sorted({ch for ch in text if ch not in _INDEX})
    if bad:
        raise ValueError(f"text: characters outside the vocabulary (newline and printable ASCII): {bad[:5]!r}")
    return torch.tensor([_INDEX[ch] for ch in text], dtype=torch.long)


def decode(ids) -> str:
    """Token ids (a 1-D tensor or list of ints in [0, 96)) -> the string they stand for.

    Example: ``decode(encode("x = 1"))`` -> ``"x = 1"``
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"ids: expected a 1-D tensor, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(VOCAB):
            raise ValueError(f"ids: expected ints in [0, {len(VOCAB)}), got {i!r}")
        out.append(VOCAB[i])
    return "".join(out)


@dataclass
class Corpus:
    """The text of both splits, as strings and as token ids.

    ``text[split]`` (str) and ``tokens[split]`` ((N,) long) for split in "train", "valid";
    ``files[split]``: the file names; ``sha256``: each file's digest here; ``differs``: the files
    whose digest is not ``REFERENCE_SHA256``'s; ``replaced``: characters mapped to ``"?"``.
    """

    text: dict
    tokens: dict
    files: dict
    sha256: dict
    replaced: int
    root: Path
    differs: list = field(default_factory=list)

    vocab = VOCAB
    vocab_size = len(VOCAB)

    @property
    def matches_reference(self) -> bool:
        """True when every file is byte for byte the one the shipped checkpoint was trained on."""
        return not self.differs

    def encode(self, text):
        return encode(text)

    def decode(self, ids):
        return decode(ids)

    def batch(self, split: str, batch_size: int, seq_len: int, generator: torch.Generator | None = None):
        """``batch_size`` windows of ``seq_len + 1`` characters at random offsets of ``split``.

        Returns (x (B, T) long, y (B, T) long) with ``y[:, t] = x[:, t + 1]``: the next
        character at every position. The offsets come from ``generator``, so a seeded generator
        gives the same batches on every machine with the same corpus.

        Example: ``x, y = corpus.batch("valid", 4, 32, torch.Generator().manual_seed(0))``
        """
        if split not in self.tokens:
            raise ValueError(f"split: expected 'train' or 'valid', got {split!r}")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
        data = self.tokens[split]                                           # (N,)
        if seq_len + 1 > data.numel():
            raise ValueError(f"seq_len: expected at most {data.numel() - 1} for split {split!r}, got {seq_len}")
        starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)   # (B,)
        offsets = starts[:, None] + torch.arange(seq_len + 1)               # (B, T + 1)
        window = data[offsets]                                              # (B, T + 1)
        return window[:, :-1], window[:, 1:]                                # (B, T), (B, T)

    def __repr__(self):
        sizes = ", ".join(f"{s}: {len(self.files[s])} files, {len(self.text[s]):,} characters" for s in self.text)
        same = "same as the reference" if self.matches_reference else f"differs from the reference in {self.differs}"
        return f"Corpus({sizes}; vocabulary {self.vocab_size}; {same})"


def load_corpus(root=None) -> Corpus:
    """Read ``TRAIN_FILES`` and ``VALID_FILES`` from the standard library (or from ``root``).

    Raises FileNotFoundError naming a missing file (some distributions split the standard
    library into packages: install the full one).

    Example: ``corpus = load_corpus(); len(corpus.text["train"])``
    """
    root = stdlib_dir() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"root: {root} is not a folder")
    text, tokens, files, digests, replaced = {}, {}, {}, {}, 0
    for split, names in (("train", TRAIN_FILES), ("valid", VALID_FILES)):
        parts = []
        for name in names:
            path = root / name
            if not path.is_file():
                raise FileNotFoundError(f"{path}: a file of the corpus is missing from the standard library")
            raw = path.read_bytes()
            digests[name] = hashlib.sha256(raw).hexdigest()
            cleaned, n = _clean(raw.decode("utf-8"))
            replaced += n
            parts.append(f"# ==== {name} ====\n{cleaned}")
        text[split] = "\n".join(parts)
        tokens[split] = encode(text[split])
        files[split] = list(names)
    differs = [n for n in (*TRAIN_FILES, *VALID_FILES) if digests[n] != REFERENCE_SHA256.get(n)]
    return Corpus(text, tokens, files, digests, replaced, root, differs)
