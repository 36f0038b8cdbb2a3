"""The names a many-model server answers to beyond its models', with stand-in engines: LoRA adapters on
their base models (given at start or loaded at run time), and created models (Ollama's /api/create and
/api/copy), which run on their base with their preset and adapter, survive a restart, flatten onto the
served base when made from another, and leave nothing behind when refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from folio.server.adapters import AdapterTable, LoRAModule
from folio.server.created_models import CreatedModel, CreatedModels, ModelPreset
from folio.server.errors import APIError
from folio.server.model_budget import ManagerOptions
from tests.unit.test_model_manager import Manager

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def run(coroutine):
    return asyncio.run(coroutine)


def _adapter_files(folder: Path) -> dict[str, Path]:
    return {"adapter_config.json": folder / "adapter_config.json",
            "adapter_model.safetensors": folder / "adapter_model.safetensors"}  # fmt: skip


def test_a_created_model_runs_on_its_base_with_its_preset_and_outlives_the_server(tmp_path):
    manager = Manager(tmp_path, ["a", "b"], ManagerOptions(max_loaded=2))
    mario = ModelPreset(system="You are Mario.", template=TEMPLATE, parameters={"temperature": 0.2},
                        messages=({"role": "user", "content": "hi"},), license="MIT")  # fmt: skip

    async def scenario():
        await manager.create("mario:latest", "a", mario)
        listed = {s.name: (s.state, s.origin, s.parent) for s in manager.statuses()}
        assert listed["mario:latest"] == ("unloaded", "created", "a")
        async with manager.use("mario:latest") as ctx:
            assert ctx.model_name == "mario:latest" and ctx.preset == mario and ctx.lora_name is None
            assert ctx.tokenizer.chat_template == TEMPLATE  # its own, in place of the base's
        async with manager.use("a") as ctx:
            assert ctx.preset is None and ctx.tokenizer.chat_template != TEMPLATE
        assert manager.loaded() == ["a"]  # one engine for both
        await manager.create("luigi", "mario:latest", ModelPreset(system="You are Luigi."))  # made from a created one
        await manager.create("copy-of-b", "b", ModelPreset())  # /api/copy
        manager.shutdown()

    run(scenario())
    again = Manager(tmp_path, [], ManagerOptions())  # the server restarted
    luigi = again.created("luigi")
    assert luigi.base == "a" and luigi.preset.system == "You are Luigi." and luigi.preset.template == TEMPLATE
    assert again.created("copy-of-b").base == "b" and again.created("mario:latest").preset == mario

    async def delete():
        await again.delete("luigi")
        with pytest.raises(APIError) as gone:
            await again.load("luigi")
        assert gone.value.status == 404
        again.shutdown()

    run(delete())
    assert not (tmp_path / ".created" / "luigi").exists()
    assert Manager(tmp_path, [], ManagerOptions()).created("luigi") is None


def test_a_created_models_adapter_is_copied_in_and_reaches_its_loaded_base(tmp_path):
    sql = _adapter_folder(tmp_path / "sql")
    table = AdapterTable([LoRAModule("sql", sql, "a")], runtime=False)
    manager = Manager(tmp_path, ["a", "b"], ManagerOptions(max_loaded=2), adapters=table)

    async def scenario():
        async with manager.use("a"):  # a loads with LoRA slots: it has an adapter
            pass
        await manager.create("sql-copy", "sql", ModelPreset())  # copied from the adapter: its files come along
        copied = manager.created("sql-copy")
        assert copied.base == "a" and Path(copied.adapter).parent == tmp_path / ".created" / "sql-copy"
        assert manager.engines[-1].adapters["sql-copy"] == copied.adapter  # registered in the loaded engine
        async with manager.use("sql-copy") as ctx:
            assert ctx.lora_name == "sql-copy"
        async with manager.use("b"):  # b has no adapter: loaded without LoRA slots
            pass
        await manager.create("b-tuned", "b", ModelPreset(), _adapter_files(Path(sql)))
        assert "b" not in manager.loaded()  # unloaded, to load again with slots for the adapter
        async with manager.use("b-tuned") as ctx:
            assert ctx.lora_name == "b-tuned"
        assert manager.engines[-1].adapters == {"b-tuned": manager.created("b-tuned").adapter}
        await manager.delete("sql-copy")
        assert "sql-copy" not in manager.engines[0].adapters and table.get("sql-copy") is None
        manager.shutdown()

    run(scenario())


def test_refused_creations_leave_nothing_behind(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "PROMPT_TUNING"}')
    (broken / "adapter_model.safetensors").write_bytes(b"")
    manager = Manager(tmp_path, ["a"], ManagerOptions())

    async def scenario():
        cases = [
            ("../escape", "a", None, 400, "not a model name"),
            ("a", "a", None, 400, "served model"),
            ("new", "nope", None, 404, "not found"),
            ("new", "a", {"adapter_config.json": broken / "adapter_config.json"}, 400, "PEFT"),
            ("new", "a", _adapter_files(broken), 400, "not a LoRA adapter"),
        ]
        for name, source, files, status, words in cases:
            with pytest.raises(APIError) as refused:
                await manager.create(name, source, ModelPreset(), files)
            assert refused.value.status == status and words in refused.value.message, refused.value.message
        assert [s.name for s in manager.statuses()] == ["a"]
        assert not any((tmp_path / ".created").glob("*/model.json"))
        manager.shutdown()

    run(scenario())


def test_a_created_model_whose_base_is_gone_is_not_served(tmp_path):
    CreatedModels(tmp_path / ".created").save(CreatedModel("x", "gone"))
    manager = Manager(tmp_path, ["a"], ManagerOptions())
    assert manager.created("x") is None and [s.name for s in manager.statuses()] == ["a"]
    assert (tmp_path / ".created" / "x" / "model.json").exists()  # its files are left for a server that has it
    manager.shutdown()


def _adapter_folder(folder: Path) -> str:
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    (folder / "adapter_model.safetensors").write_bytes(b"")  # only its presence is checked before a load
    return str(folder)


def test_adapters_load_with_their_base_model_and_at_run_time(tmp_path):
    """An adapter names its base: a request for it loads the base (with LoRA slots) and runs with the
    adapter set; a base loaded anew gets its adapters again; run-time adapters load the base first."""
    sql = _adapter_folder(tmp_path / "sql")
    table = AdapterTable([LoRAModule("sql", sql, "a:latest")], runtime=True)
    manager = Manager(tmp_path, ["a", "b"], ManagerOptions(max_loaded=1), adapters=table)
    assert manager.engine_args(manager.sources.find("b")).enable_lora  # --runtime-lora: every model may get one

    async def scenario():
        assert {s.name: (s.state, s.parent) for s in manager.statuses()}["sql"] == ("unloaded", "a")
        async with manager.use("sql") as ctx:
            assert (ctx.model_name, ctx.lora_name) == ("sql", "sql")
        assert manager.loaded() == ["a"] and manager.engines[-1].adapters == {"sql": sql}
        assert {s.name: s.state for s in manager.statuses()}["sql"] == "loaded"
        async with manager.use("a") as ctx:
            assert ctx.lora_name is None
        await manager.load_adapter("chat", sql, "b")  # b loads (a makes way), then takes the adapter
        assert manager.loaded() == ["b"] and manager.engines[-1].adapters == {"chat": sql}
        async with manager.use("sql:latest"):  # a again, its adapter registered in its new engine
            pass
        assert manager.engines[-1].name == "a" and manager.engines[-1].adapters == {"sql": sql}
        await manager.unload("chat")  # an adapter's name loads and unloads its base
        with pytest.raises(APIError) as delete:
            await manager.delete("sql")
        assert delete.value.status == 400 and "LoRA adapter" in delete.value.message
        await manager.unload_adapter("sql")
        assert manager.engines[-1].adapters == {}
        with pytest.raises(APIError) as gone:
            async with manager.use("sql"):
                pass
        assert gone.value.status == 404 and "chat" in gone.value.message
        manager.shutdown()

    run(scenario())


def test_adapters_that_cannot_be_served_are_refused_before_anything_changes(tmp_path):
    sql = _adapter_folder(tmp_path / "sql")
    with pytest.raises(ValueError, match="base_model_name"):  # NAME=PATH among several models
        Manager(tmp_path, ["a", "b"], ManagerOptions(), adapters=AdapterTable([LoRAModule("sql", sql)], False))
    with pytest.raises(ValueError, match="does not serve"):
        Manager(tmp_path, ["a"], ManagerOptions(), adapters=AdapterTable([LoRAModule("sql", sql, "zz")], False))
    with pytest.raises(ValueError, match="served model's name"):
        Manager(tmp_path, ["a"], ManagerOptions(), adapters=AdapterTable([LoRAModule("a", sql, "a")], False))
    with pytest.raises(ValueError, match="adapter_config.json"):
        Manager(tmp_path, ["a"], ManagerOptions(), adapters=AdapterTable([LoRAModule("x", str(tmp_path), "a")], False))
    fixed = Manager(tmp_path, ["a", "b"], ManagerOptions(), adapters=AdapterTable([LoRAModule("sql", sql, "a")], False))
    assert fixed.engine_args(fixed.sources.find("a")).enable_lora
    assert not fixed.engine_args(fixed.sources.find("b")).enable_lora  # no adapter, no LoRA slots

    async def scenario():
        with pytest.raises(APIError, match="--runtime-lora"):
            await fixed.load_adapter("chat", sql, "a")
        fixed.adapters.runtime = True
        for name, path, base, param in (("chat", sql, None, "base_model_name"), ("b", sql, "a", "lora_name"),
                                        ("chat", str(tmp_path / "broken"), "a", "lora_path")):  # fmt: skip
            with pytest.raises(APIError) as refused:
                await fixed.load_adapter(name, path, base)
            assert refused.value.status == 400 and refused.value.param == param
        assert [s.name for s in fixed.statuses()] == ["a", "b", "sql"]  # nothing was added
        async with fixed.use("a") as ctx:  # the base the refused adapter loaded serves on
            assert ctx.admission.in_flight == 0
        with pytest.raises(APIError) as unknown:
            await fixed.unload_adapter("chat")
        assert unknown.value.status == 404
        fixed.shutdown()

    run(scenario())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sql=/lora/sql", LoRAModule("sql", "/lora/sql")),
        ('{"name": "sql", "path": "/lora/sql", "base_model_name": "a"}', LoRAModule("sql", "/lora/sql", "a")),
    ],
)
def test_lora_modules_entries_parse_as_vllms(text, expected):
    assert LoRAModule.parse(text) == expected


@pytest.mark.parametrize(
    "text", ["sql", "=/p", '{"name": "sql"}', '{"name": "sql", "path": "/p", "rank": 4}', "{nope", "[1]"]
)
def test_bad_lora_modules_entries_are_one_line_errors(text):
    with pytest.raises(ValueError, match="--lora-modules"):
        LoRAModule.parse(text)
