"""Created models (Ollama's /api/create and /api/copy) on the many-model manager, with stand-in engines:
a created model runs on its base with its preset and adapter, survives a restart, flattens onto the
served base when made from another, and a refused one leaves nothing behind."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from folio.server.adapters import AdapterTable, LoRAModule
from folio.server.created_models import CreatedModel, CreatedModels, ModelPreset
from folio.server.errors import APIError
from folio.server.model_budget import ManagerOptions
from tests.unit.test_model_manager import Manager, _adapter_folder

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
