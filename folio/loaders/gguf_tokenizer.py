"""Build a Hugging Face `tokenizers.Tokenizer` from the vocabulary a GGUF file carries.

A GGUF has no tokenizer.json: it stores tokens, token types, merges or scores and special-token ids
under llama.cpp's key names. Our reference is what transformers builds from the same file
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`): the ids and decoded text must be identical, so
every choice below (normalizer, pre-tokenizer, which tokens are added, merge order) mirrors it.

Three shapes are supported:
  * byte-level BPE (`tokenizer.ggml.model == "gpt2"`, e.g. SmolLM2), merges stored in the file;
  * Gemma's SentencePiece BPE (`"llama"` on an architecture of the "gemma" tokenizer family, which
    its model module declares): spaces become U+2581 in a
    normalizer, byte fallback, merges rebuilt from the vocabulary in file order;
  * other SentencePiece BPE (`"llama"`): a Metaspace pre-tokenizer, merges rebuilt from the scores.

Building Gemma's 262k vocabulary takes a few seconds, so `load_gguf_tokenizer` caches the result as
tokenizer JSON under `folio_home()/tokenizers/`.
"""

from __future__ import annotations

import glob
import hashlib
import json
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from folio.loaders.gguf_file import GGUFFile
from folio.models.registry import gguf_architecture
from folio.paths import atomic_open, folio_home

# Bump when the builder's output changes, so stale cache entries are never read.
CACHE_VERSION = 2
SPIECE_SPACE = "\u2581"
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
# Gemma 1 and 2 have no model module; their vocabularies are Gemma's as well.
UNREGISTERED_FAMILIES = {"gemma": "gemma", "gemma2": "gemma"}
# Token names the matching transformers class (GPT2Tokenizer, GemmaTokenizer, LlamaTokenizer) treats as
# special by default.
DEFAULT_SPECIALS = {
    "gpt2": ("<|endoftext|>",),
    "gemma": ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>"),
    "llama": ("<unk>", "<s>", "</s>"),
}

# Split patterns for byte-level vocabularies whose merges were learned on something other than GPT-2's
# default split. Unlisted `tokenizer.ggml.pre` values (e.g. SmolLM2's "smollm") use ByteLevel's own regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


class GGUFTokenizerError(ValueError):
    """The file's tokenizer metadata is missing or of a kind we cannot rebuild."""


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer metadata of one GGUF file, as plain values."""

    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    architecture: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> GGUFVocab:
        meta = gguf.metadata
        if "tokenizer.ggml.tokens" not in meta:
            raise GGUFTokenizerError(f"{gguf.path}: no tokenizer.ggml.tokens in the file")
        model = str(meta.get("tokenizer.ggml.model", ""))
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = meta.get("tokenizer.ggml.token_type")
        scores = meta.get("tokenizer.ggml.scores")

        def opt_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return None if value is None else int(value)

        # Old SentencePiece files carry no flag and llama.cpp then adds BOS; transformers follows it.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama"))
        return cls(
            model=model,
            architecture=gguf.architecture,
            pre=meta.get("tokenizer.ggml.pre"),
            tokens=tokens,
            token_types=[] if types is None else np.asarray(types).tolist(),
            scores=None if scores is None else np.asarray(scores, dtype=np.float64).tolist(),
            merges=meta.get("tokenizer.ggml.merges"),
            bos_id=opt_id("bos_token_id"),
            eos_id=opt_id("eos_token_id"),
            unk_id=opt_id("unknown_token_id"),
            pad_id=opt_id("padding_token_id"),
            add_bos=add_bos,
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        )

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table: printable Latin-1 bytes map to themselves,
    the rest (controls, space, soft hyphen...) to code points from U+0100 upward, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0x100
    for b in range(256):
        if b not in table:
            table[b] = chr(extra)
            extra += 1
    return table


def derive_merges(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary without a merge list: every way to cut a token into two vocabulary
    pieces is a merge. Best rank first; ties go to the longer left piece, then the longer right piece,
    then the order of `rank` (a stable sort, as transformers does)."""
    vocab = set(tokens)
    found: list[tuple[float, int, int, str, str]] = []
    append = found.append
    for token, score in rank.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                append((-score, -cut, cut - len(token), left, right))
    found.sort(key=lambda m: m[:3])
    return [(m[3], m[4]) for m in found]


def _byte_level(vocab: GGUFVocab) -> tuple[Tokenizer, set[str]]:
    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (rare mislabels) are respelled byte by byte.
    ids = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(vocab.tokens)
    }
    if vocab.merges is None:
        raise GGUFTokenizerError("byte-level BPE file has no tokenizer.ggml.merges")
    merges = _parse_merges(vocab.merges)
    tok = Tokenizer(BPE(ids, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = BYTE_LEVEL_SPLITS.get(vocab.pre or "")
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    if split is not None:  # the vocabulary's own split, then ByteLevel only respells the bytes
        pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), pre])
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _parse_merges(merges: list[str]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in merges]


def _sentencepiece(vocab: GGUFVocab, gemma: bool) -> Tokenizer:
    tokens = vocab.tokens
    if gemma:
        # Gemma stores its multi-space tokens as real spaces; the normalizer produces U+2581, so respell
        # them. Its scores do not follow merge order; the file order does.
        tokens = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    ids = {t: i for i, t in enumerate(tokens)}
    if vocab.merges is not None:
        merges = _parse_merges(vocab.merges)
    elif gemma:
        merges = derive_merges(tokens, {t: -float(i) for i, t in enumerate(tokens)})
    elif vocab.scores is not None:
        merges = derive_merges(tokens, dict(zip(tokens, vocab.scores, strict=True)))
    else:
        raise GGUFTokenizerError("SentencePiece file has neither merges nor scores")
    unk = vocab.token(vocab.unk_id) if gemma else None
    tok = Tokenizer(BPE(ids, merges, dropout=None, fuse_unk=True, byte_fallback=True, unk_token=unk))
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
        # After the normalizer there is no space left to split on; kept to match the reference exactly.
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_SPACE, prepend_scheme="first", split=False)
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _add_special_tokens(tok: Tokenizer, vocab: GGUFVocab, alphabet: set[str] | None, style: str) -> None:
    """Control tokens become special added tokens (kept whole, dropped by skip_special_tokens);
    user-defined ones become plain added tokens (kept whole, always decoded)."""
    types = vocab.token_types
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(vocab.tokens, types, strict=False)
        # In a byte-level vocabulary a control token outside the alphabet is a llama.cpp mislabel.
        if kind == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    tok.add_special_tokens(control)
    known = tok.get_vocab()
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(vocab.tokens, types, strict=False)
        if kind == USER_DEFINED and t in known
    ]
    tok.add_tokens(user)
    # The file's named tokens, and the reference class's default names, are special whatever their type.
    # Unlike transformers we skip default names the vocabulary lacks: it would append them as new ids
    # past the model's embedding table.
    named = [vocab.token(i) for i in (vocab.bos_id, vocab.eos_id, vocab.unk_id, vocab.pad_id)]
    named += [t for t in DEFAULT_SPECIALS[style] if t in known]
    added = {str(t) for t in control + user}
    extra = [AddedToken(t, special=True) for t in dict.fromkeys(named) if t is not None and t not in added]
    if extra:
        tok.add_special_tokens(extra)


def _post_processor(vocab: GGUFVocab) -> processors.TemplateProcessing:
    bos, eos = vocab.token(vocab.bos_id), vocab.token(vocab.eos_id)
    add_bos, add_eos = vocab.add_bos and bos is not None, vocab.add_eos and eos is not None

    def template(seq: str, type_id: int) -> str:
        parts = [f"{bos}:{type_id}"] if add_bos else []
        parts.append(f"${seq}:{type_id}")
        if add_eos:
            parts.append(f"{eos}:{type_id}")
        return " ".join(parts)

    special = ([(bos, vocab.bos_id)] if add_bos else []) + ([(eos, vocab.eos_id)] if add_eos else [])
    return processors.TemplateProcessing(
        single=template("A", 0), pair=f"{template('A', 0)} {template('B', 1)}", special_tokens=special
    )


def tokenizer_family(gguf_architecture_name: str) -> str:
    """The vocabulary family the architecture's module declares ("llama" for one folio cannot run)."""
    try:
        return gguf_architecture(gguf_architecture_name).tokenizer_family
    except ValueError:
        return UNREGISTERED_FAMILIES.get(gguf_architecture_name, "llama")


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """The tokenizer transformers would build from this metadata."""
    if vocab.model == "gpt2":
        style = "gpt2"
        tok, alphabet = _byte_level(vocab)
    elif vocab.model == "llama":
        style = "gemma" if tokenizer_family(vocab.architecture) == "gemma" else "llama"
        tok, alphabet = _sentencepiece(vocab, gemma=style == "gemma"), None
    else:
        raise GGUFTokenizerError(f"tokenizer.ggml.model {vocab.model!r} is not supported (supported: 'gpt2', 'llama')")
    _add_special_tokens(tok, vocab, alphabet, style)
    tok.post_processor = _post_processor(vocab)
    return tok


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """Build without the cache."""
    return build_tokenizer(GGUFVocab.from_gguf(GGUFFile(path)))


def _cache_path(gguf_path: Path) -> Path:
    """`<stem>-<which file>-<which version of it>.json`, so entries for older versions can be found."""
    stat = gguf_path.stat()
    where = hashlib.sha256(str(gguf_path.resolve()).encode()).hexdigest()[:12]
    state = hashlib.sha256(f"v{CACHE_VERSION}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return folio_home() / "tokenizers" / f"{gguf_path.stem}-{where}-{state}.json"


def _compact_json(tok: Tokenizer) -> str:
    """Tokenizer JSON with merges written as "a b" strings, which parse about twice as fast as pairs.
    Only done when no merge piece contains a space, where the string form would be ambiguous."""
    data = json.loads(tok.to_str())
    merges = data.get("model", {}).get("merges")
    if merges and not any(" " in a or " " in b for a, b in merges):
        data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(data, ensure_ascii=False)


def load_gguf_tokenizer(gguf_path: str | Path) -> Tokenizer:
    """The file's tokenizer, from the cache when the file is unchanged since it was built."""
    gguf_path = Path(gguf_path)
    cache = _cache_path(gguf_path)
    if cache.is_file():
        try:
            return Tokenizer.from_file(str(cache))
        except Exception:  # a damaged cache entry is rebuilt, never fatal
            cache.unlink(missing_ok=True)
    tok = tokenizer_from_gguf(gguf_path)
    with suppress(OSError):  # a read-only cache dir only costs speed
        cache.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(cache) as f:
            f.write(_compact_json(tok))
        stem = cache.name.rsplit("-", 1)[0]
        for stale in cache.parent.glob(f"{glob.escape(stem)}-*.json"):  # entries for earlier versions of this file
            if stale != cache:
                stale.unlink(missing_ok=True)
    return tok
