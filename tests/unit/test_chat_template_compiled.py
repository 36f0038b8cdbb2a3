"""The chat template is compiled once per tokenizer, on first use, and reused for every render; a template
that does not compile fails each render with ChatTemplateError, never the model's loading."""

from __future__ import annotations

import pickle

import jinja2.sandbox
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from folio.loaders.tokenizer import ChatTemplateError, Tokenizer

CHATML = (
    "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(template: str) -> Tokenizer:
    return Tokenizer(HFTokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")), template, None, None, frozenset())


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every template source compiled from now on."""
    sources: list[str] = []
    real = jinja2.sandbox.ImmutableSandboxedEnvironment.from_string

    def counting(self: jinja2.Environment, source: str, *args: object, **kwargs: object) -> jinja2.Template:
        sources.append(source)
        return real(self, source, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(jinja2.sandbox.ImmutableSandboxedEnvironment, "from_string", counting)
    return sources


def test_the_template_is_compiled_once_and_reused(compiles: list[str]) -> None:
    tokenizer = _tokenizer(CHATML)
    assert compiles == []  # not at load time
    first = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    second = tokenizer.apply_chat_template([{"role": "user", "content": "Grüezi"}], add_generation_prompt=False,
                                           tools=[{"name": "ß"}])  # fmt: skip
    assert first == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert second == '<|im_start|>user\nGrüezi<|im_end|>\n[{"name": "ß"}]'  # tojson keeps non-ASCII
    assert compiles == [CHATML]
    with pytest.raises(ChatTemplateError, match="chat template failed: no tool turns"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])  # raise_exception, as before
    assert compiles == [CHATML]
    assert _tokenizer(CHATML).apply_chat_template([{"role": "user", "content": "Hi"}]) == first
    assert compiles == [CHATML, CHATML]  # once per tokenizer


def test_a_template_that_does_not_compile_fails_each_render_not_the_load(compiles: list[str]) -> None:
    tokenizer = _tokenizer("{% for m in messages %}{{ m.content }")  # loads fine
    for _ in range(2):
        with pytest.raises(ChatTemplateError, match="^chat template failed: ") as caught:
            tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
        assert isinstance(caught.value.__cause__, jinja2.TemplateSyntaxError)
    assert len(compiles) == 1  # the failure is remembered too
    assert not tokenizer.renders_tools


def test_a_tokenizer_that_has_rendered_still_pickles() -> None:
    """The engine process sends its tokenizer to the API side (EngineInfo): compiled code does not pickle."""
    tokenizer = _tokenizer(CHATML)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy.apply_chat_template([{"role": "user", "content": "Hi"}]) == text
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]) == text
