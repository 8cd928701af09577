"""Tokenizers for the offline presets, built from open_clip's shipped BPE file.

No network here: the CLIP vocabulary is derived from ``bpe_simple_vocab_16e6.txt.gz`` exactly
as OpenAI's CLIP derives it (so ids match ``openai/clip-vit-*`` tokenizers), and a small
T5-style Unigram vocabulary is derived from the same BPE ranks. The generated files are cached
under ``<cache dir>/tokenizers`` and written atomically, so concurrent processes agree.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import tempfile
from pathlib import Path

from transformers import CLIPTokenizer, T5Tokenizer

CLIP_VOCAB_SIZE = 49408
T5_SOURCE_PIECES = 8192
"""How many leading CLIP vocabulary entries (bytes, then merges by rank) seed the T5 vocabulary."""


def _bpe_path() -> Path:
    import open_clip.tokenizer

    return Path(open_clip.tokenizer.default_bpe())


def _bytes_to_unicode() -> dict[int, str]:
    """OpenAI's reversible byte -> printable unicode map (same as open_clip's and GPT-2's)."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _clip_merges_and_vocab() -> tuple[list[str], dict[str, int]]:
    lines = gzip.open(_bpe_path()).read().decode("utf-8").split("\n")
    merges = lines[1 : 49152 - 256 - 2 + 1]
    chars = list(_bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    assert len(tokens) == CLIP_VOCAB_SIZE
    return merges, {t: i for i, t in enumerate(tokens)}


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def clip_tokenizer_files(cache_dir: Path) -> Path:
    """Write (once) ``vocab.json`` and ``merges.txt`` of OpenAI's CLIP tokenizer; return the folder."""
    folder = cache_dir / "tokenizers" / "clip-bpe-16e6"
    vocab_file, merges_file = folder / "vocab.json", folder / "merges.txt"
    if not (vocab_file.is_file() and merges_file.is_file()):
        merges, vocab = _clip_merges_and_vocab()
        _write_atomic(merges_file, "#version: 0.2\n" + "\n".join(merges) + "\n")
        _write_atomic(vocab_file, json.dumps(vocab, ensure_ascii=False))
    return folder


def load_clip_tokenizer(cache_dir: Path, max_length: int = 77) -> CLIPTokenizer:
    """OpenAI's CLIP tokenizer (49,408 ids), built offline from open_clip's BPE file."""
    folder = clip_tokenizer_files(cache_dir)
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    merges = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]
    pairs = [tuple(m.split()) for m in merges if m]
    # the tokenizers BPE model wants merges as pairs; transformers' hint says strings
    return CLIPTokenizer(vocab=vocab, merges=pairs, model_max_length=max_length)  # type: ignore[arg-type]


def _t5_pieces() -> list[tuple[str, float]]:
    """Unigram pieces from the CLIP vocabulary's first entries, scored by BPE rank."""
    _, vocab = _clip_merges_and_vocab()
    byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
    pieces: dict[str, float] = {}
    for token, rank in list(vocab.items())[:T5_SOURCE_PIECES]:
        stem = token.removesuffix("</w>")
        try:
            text = bytes(byte_decoder[c] for c in stem).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        if not text.isprintable() or " " in text:
            continue
        score = -math.log(rank + 2)
        pieces.setdefault("▁" + text, score)
        pieces.setdefault(text, score - 1.0)  # a word-inner piece is a little less likely
    return sorted(pieces.items(), key=lambda kv: (-kv[1], kv[0]))


def t5_vocab_file(cache_dir: Path) -> Path:
    """Write (once) the T5-style Unigram vocabulary as JSON ``[[piece, score], ...]``."""
    path = cache_dir / "tokenizers" / f"t5-unigram-{T5_SOURCE_PIECES}" / "unigram.json"
    if not path.is_file():
        specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
        _write_atomic(path, json.dumps(specials + _t5_pieces(), ensure_ascii=False))
    return path


def load_t5_tokenizer(cache_dir: Path, max_length: int = 512) -> T5Tokenizer:
    """A T5-style (SentencePiece Unigram) tokenizer, built offline; ids 0/1/2 = pad/eos/unk."""
    vocab = [(p, s) for p, s in json.loads(t5_vocab_file(cache_dir).read_text(encoding="utf-8"))]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)
