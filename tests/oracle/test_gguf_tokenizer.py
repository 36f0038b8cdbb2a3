"""Our GGUF tokenizer against transformers' (AutoTokenizer with gguf_file=...) on the real models."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer

import folio.loaders.gguf_tokenizer as gt
from folio.loaders.gguf_tokenizer import byte_to_unicode, load_gguf_tokenizer, tokenizer_from_gguf

transformers = pytest.importorskip("transformers")

COMMON = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces and trailing   ",
    "trailing space ",
    "a  b   c    d     e",
    " ",
    "      ",
    "line one\nline two\n\nline four\n",
    "\n\n\nstarts with newlines",
    "windows\r\nline\r\nends",
    "tab\tseparated\t\tvalues\t",
    "\t\tindented with tabs",
    "mixed \t \n \t\n  whitespace",
    "Café naïve résumé coöperate façade Ångström",
    "日本語のテキストと中文文本",
    "한국어 텍스트",
    "مرحبا بالعالم",
    "Здравствуй, мир",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "x = {'a': [1, 2, 3], \"b\": None}  # comment",
    "3.14159 2718281828 1,000,000 -42 0x1F 1e-9 2024-05-17",
    "123456789012345678901234567890",
    "don't won't it's I'm we'll they've you'd",
    "URL: https://example.com/path?query=1&b=2#frag",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "rare chars: \u0000 \u0007 \u00ad \u200b \ufeff \U0001d54f \U00020000",
    "combining: e\u0301 a\u0308",
]

SMOLLM2_SPECIAL = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|><|im_end|><|endoftext|>",
    "partial <|im_start and <|im_end",
    "<repo_name>folio<file_sep>main.py<gh_stars>100",
    "<fim_prefix>def f(<fim_suffix>)<fim_middle>",
    " <|im_start|> spaced <|im_end|> ",
]

GEMMA_SPECIAL = [
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user",
    "text<eos>more",
    "<pad><unk><mask>",
    "partial <start_of_turn and <end_of_",
    "<start_of_image><end_of_image>",
    " <start_of_turn> spaced <end_of_turn> ",
    "<unused0><unused6241>[multimodal]",
]

MODELS = {
    "smollm2": ("smollm2_gguf", SMOLLM2_SPECIAL),
    "gemma3": ("gemma3_gguf", GEMMA_SPECIAL),
}


class Pair:
    """Transformers' tokenizer and ours for one file, loaded once per session."""

    def __init__(self, path: Path) -> None:
        self.path = path
        start = time.perf_counter()
        self.hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.hf_seconds = time.perf_counter() - start
        self.fresh = tokenizer_from_gguf(path)
        self.cached = load_gguf_tokenizer(path)  # builds the cache entry if missing
        self.reloaded = load_gguf_tokenizer(path)  # now from the cache


@pytest.fixture(scope="session", params=sorted(MODELS))
def pair(request: pytest.FixtureRequest) -> tuple[Pair, list[str]]:
    fixture_name, specials = MODELS[request.param]
    return Pair(request.getfixturevalue(fixture_name)), specials


def ours_all(pair: Pair) -> dict[str, Tokenizer]:
    return {"fresh": pair.fresh, "cached": pair.cached, "reloaded": pair.reloaded}


def test_backend_matches_transformers_component_by_component(pair: tuple[Pair, list[str]]) -> None:
    p, _ = pair
    ours, ref = json.loads(p.fresh.to_str()), json.loads(p.hf.backend_tokenizer.to_str())
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens"):
        assert ours[key] == ref[key], key
    assert ours["model"]["vocab"] == ref["model"]["vocab"]
    assert ours["model"]["merges"] == ref["model"]["merges"]
    assert {k: v for k, v in ours["model"].items() if k not in ("vocab", "merges")} == {
        k: v for k, v in ref["model"].items() if k not in ("vocab", "merges")
    }


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_match_transformers(pair: tuple[Pair, list[str]], add_special_tokens: bool) -> None:
    p, specials = pair
    for text in COMMON + specials:
        expected = p.hf(text, add_special_tokens=add_special_tokens)["input_ids"]
        for kind, tok in ours_all(p).items():
            got = tok.encode(text, add_special_tokens=add_special_tokens).ids
            assert got == expected, (kind, text)


def test_batch_of_long_text_matches(pair: tuple[Pair, list[str]]) -> None:
    p, specials = pair
    text = "\n".join(COMMON + specials) * 3
    assert p.reloaded.encode(text).ids == p.hf(text)["input_ids"]


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_matches_transformers(pair: tuple[Pair, list[str]], skip_special_tokens: bool) -> None:
    p, specials = pair
    id_lists = [p.hf(text)["input_ids"] for text in COMMON + specials]
    # Arbitrary id sequences too: they hit lone byte-fallback pieces and broken UTF-8.
    rng = random.Random(0)
    vocab_size = p.hf.backend_tokenizer.get_vocab_size()
    id_lists += [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(200)]
    for ids in id_lists:
        expected = p.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        for kind, tok in ours_all(p).items():
            assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == expected, (kind, ids)


def test_special_tokens_are_single_ids(pair: tuple[Pair, list[str]]) -> None:
    p, specials = pair
    first = specials[0]
    ids = p.reloaded.encode(first, add_special_tokens=False).ids
    tokens = [p.reloaded.id_to_token(i) for i in ids]
    opening = first.split(">")[0] + ">"  # '<|im_start|>' / '<start_of_turn>'
    assert tokens[0] == opening


def test_cache_is_keyed_on_the_file(smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOLIO_HOME", str(tmp_path / "home"))
    copy = tmp_path / smollm2_gguf.name
    shutil.copyfile(smollm2_gguf, copy)
    builds = []
    real_build = gt.tokenizer_from_gguf
    monkeypatch.setattr(gt, "tokenizer_from_gguf", lambda path: builds.append(path) or real_build(path))

    first = gt.load_gguf_tokenizer(copy)
    assert len(builds) == 1 and len(list((tmp_path / "home" / "tokenizers").glob("*.json"))) == 1
    again = gt.load_gguf_tokenizer(copy)
    assert len(builds) == 1  # served from the cache
    assert again.encode("<|im_start|>user\nhi").ids == first.encode("<|im_start|>user\nhi").ids

    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    gt.load_gguf_tokenizer(copy)
    assert len(builds) == 2  # a changed file is rebuilt, not served stale

    (entry,) = (tmp_path / "home" / "tokenizers").glob("*.json")  # the stale entry was removed
    entry.write_text("{ not json")
    assert gt.load_gguf_tokenizer(copy).encode("hi").ids == first.encode("hi").ids
    assert len(builds) == 3  # a damaged entry is rebuilt, not fatal


# -- shapes the two real models do not cover, on small files written here ---------------------------


def write_tokenizer_gguf(
    path: Path,
    model: str,
    tokens: list[str],
    types: list[int],
    pre: str | None = None,
    scores: list[float] | None = None,
    merges: list[str] | None = None,
) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_as_transformers(path: Path, texts: list[str]) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = tokenizer_from_gguf(path)
    assert json.loads(ours.to_str()) == json.loads(hf.backend_tokenizer.to_str())
    for text in texts:
        for add in (True, False):
            ids = hf(text, add_special_tokens=add)["input_ids"]
            assert ours.encode(text, add_special_tokens=add).ids == ids, (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


SMALL_TEXTS = ["", "abc", " abc  ab", "cab\tbca\n", "<s>abc</s>", "x <tool> é 😀", "the 1234 them", "<|begin|>12 the"]


def test_plain_sentencepiece_merges_come_from_scores(tmp_path: Path) -> None:
    pieces = ["▁", "a", "b", "c", "▁a", "ab", "bc", "▁ab", "abc", "▁abc", "ca", "cab"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<tool>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4]
    # Scores deliberately out of file order, with a tie, so ordering by score is what is tested.
    scores = [0.0] * 259 + [-5.0, -1.0, -2.0, -3.0, -4.0, -0.5, -6.0, -7.0, -0.5, -8.0, -9.0, -2.5] + [0.0]
    path = write_tokenizer_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores)
    assert_same_as_transformers(path, SMALL_TEXTS)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "default"])
def test_byte_level_split_patterns(tmp_path: Path, pre: str) -> None:
    alphabet = [byte_to_unicode()[b] for b in range(256)]
    merged = ["Ġt", "he", "Ġthe", "Ġthem", "12", "123", "ab", "abc", "<|endoftext|>"]
    specials = ["<unk>", "<|begin|>", "<|end|>", "<| spaced |>"]  # the last is outside the byte alphabet
    tokens = specials + alphabet + merged + ["<tool>", "a b"]
    types = [3] * len(specials) + [1] * (len(alphabet) + len(merged)) + [4, 1]
    merges = ["Ġ t", "h e", "Ġt he", "Ġthe m", "1 2", "12 3", "a b", "ab c"]
    path = write_tokenizer_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, types, pre=pre, merges=merges)
    assert_same_as_transformers(path, SMALL_TEXTS + ["<| spaced |>", "a b", "x<|endoftext|>y"])


def test_default_special_names_missing_from_the_vocabulary_are_not_added(tmp_path: Path) -> None:
    # transformers appends '<|endoftext|>' past the vocabulary here (id 262 of 262); an engine must
    # never produce an id the model's embedding table lacks.
    alphabet = [byte_to_unicode()[b] for b in range(256)]
    tokens = ["<unk>", "<|begin|>", "<|end|>"] + alphabet + ["ab", "abc"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    path = write_tokenizer_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, types, merges=["a b", "ab c"])
    ours = tokenizer_from_gguf(path)
    assert ours.get_vocab_size(with_added_tokens=True) == len(tokens)
    assert max(ours.encode("x<|endoftext|>abc<|end|>").ids) < len(tokens)
